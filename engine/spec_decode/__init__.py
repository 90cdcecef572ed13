"""Speculative decoding: proposers draft tokens, the target model verifies them in its step.

Modules: `spec_config` (the user's `speculative_config`), `ngram_proposer` and
`draft_proposer` (the drafts), `spec_scheduling` (how many drafts a request verifies in a
step), `rejection_sampler` (greedy and distribution-preserving verification), `verifier`
(the model runner's side: logits of every verified position), `spec_stats` (counters).
"""

"""Prefill/decode disaggregation: engine roles, KV export/import and the KV connector."""

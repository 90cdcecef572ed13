"""Who is calling and what they may do: API keys, the tenant policy file, rate limits.

- `api_keys`: key in metadata -> tenant (the tenant is the cache salt).
- `tenant_policy`: the policy file (keys, per-tenant limits); `config_file` reads JSON/YAML
  with errors naming the line; `policy_reload` re-reads it while running.
- `request_rules`: a tenant's per-request rules (model, priority, max_tokens) before any work.
- `rate_limit`: limits shared by every replica (one Redis Lua call, `rate_limit.lua`);
  `local_rate_limit`: what a replica enforces alone while Redis is down;
  `rate_limit_types`: what a check asks and answers.
"""

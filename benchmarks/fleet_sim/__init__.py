"""Fleet simulator (issue 36): the router's own routing code over N simulated engines.

`python -m benchmarks.fleet_sim --engines 64 --tenants 1000 --seed 0 --json out.json`.
Engines are modelled (`engine_model`, `prefix_cache`) with a cost model calibrated from the
real engine (`calibration`); their state is published to a real Redis as real engines publish
it (`publisher`); the router's `EngineSelector` decides on it (`routers`); a discrete-event
loop in virtual time drives it all (`simulator`) over seeded workloads (`workload`); figures
per policy come from `metrics` and `report`. docs/fleet-simulator.md describes the model.
"""

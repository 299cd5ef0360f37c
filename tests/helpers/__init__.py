"""The test and ops harness, shared by tests/ and scripts/: import it as `pagedserve.tests.helpers.<module>`.

- tiny_models: random-weight HF models (and tokenizers) small enough for a 2-core CPU, and helpers that
  run our model directly;
- server: `engine-serve` as a real subprocess (Server), free ports, process RSS and fds;
- metrics: the one reader of the server's Prometheus /metrics;
- attention_cases: random paged-attention batches for the reference and kernel tests.
"""

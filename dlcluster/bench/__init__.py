"""make bench and make bench-ae: Ray Train against each job's own launcher, TensorFlow's strategies,
FSDP2 against DDP, and the tutorial's table (the figures: docs/benchmark.md)."""

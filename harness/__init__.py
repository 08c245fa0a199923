"""What the tests, the benches and the load tests share: real processes on free ports, waits with
deadlines, deterministic images and tiny seeded checkpoints."""

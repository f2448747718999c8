"""The train benchmarks behind benchmarks/train_throughput.py, one module each (gen, step, eyrie, loader, ab), with
their shared helpers (common) and the profile analysis (profile); entry_hooks runs inside the trainer's process."""

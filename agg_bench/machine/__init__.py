"""The machine: the processes, devices and measurements a run executes on.

Data parallelism over torchrun's processes (distributed), FSDP2 sharding and its lockstep (fsdp),
timers, memory, saved activations, NVML and the environment (telemetry), the file-lock GPU pool
(gpus) and the device a config names (devices). None of it knows a model or a method, and the engine and the methods call into it (a forward
counts its saved activations, an estimator agrees its loop lengths with its peers), so it sits below
them. It imports the top-level basics only (the record contract among them; ``tests/unit/test_import_graph.py``).
"""

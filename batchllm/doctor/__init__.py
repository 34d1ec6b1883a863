"""`batchllm doctor`: the machine (machine.py) and the services a run and the fleet use
(diagnose.py), checked in a few seconds without starting an engine."""

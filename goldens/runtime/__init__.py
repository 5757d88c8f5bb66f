"""How OLMo-core is built and run on this CPU: its models, the CPU stand-ins, recorders, VJPs."""

"""NVML, the driver's management library: the only part that imports pynvml.

``session`` loads it by absolute path and pairs init with shutdown; ``facts`` reads what
discovery caches (driver, GPUs, MIG devices); ``mig`` creates and destroys MIG instances
for the provisioning part. Discovery and provision import it; nothing in the core does.
"""

"""The device and the host link: device-byte meters (memory.py), the offload runtime (runtime.py)
and the modelled step time's parts (speed.py)."""

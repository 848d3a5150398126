"""What the container asks for: NVIDIA_* variables and device-plugin mounts → GpuRequest."""

"""Where a run executes: devices, meshes and the multi-process runtime."""

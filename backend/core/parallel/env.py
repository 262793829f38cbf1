"""Environment every process of a tensor-parallel engine runs with (no torch here, so
the serving layer can set it for the processes it starts)."""

# NCCL's NVLink SHARP, torch's symmetric-memory multicast and NVSHMEM's stay off: the
# multi-GPU hosts this runs on do not serve NVLink multicast
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

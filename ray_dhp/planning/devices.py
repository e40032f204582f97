"""The accelerators a plan is made for (the planner's device table) and the margin a verdict keeps.

Each `Accelerator` has a name (the run file's ``scaling.accelerator``, ``ray-dhp plan --device``),
the substring of ``torch.cuda.get_device_name()`` that recognises it (`ray_dhp.planning.flops`
takes its dense bf16 peak from here), its memory and its default **device margin**: the bytes a
training process holds beyond the tensors the plan counts. ``memory_gib`` is the total CUDA
reports (``torch.cuda.get_device_properties(i).total_memory``, a little below the marketed
size: the driver reserves some), to 0.1 GiB; not measured here (no GPU): ``--device-gib``
replaces it.

The margin is the sum of three parts (``margin_gib``), none of them measured on this machine (it
has no GPU); the figures and their sources:

* **CUDA context**, ``CONTEXT_GIB`` = 0.5: the driver, cuBLAS/cuDNN handles and workspaces and
  the kernels loaded so far; ~0.3-0.4 GiB per process with CUDA >= 11.7's lazy module loading
  (PyTorch maintainers in pytorch/pytorch#107667, #109888), more once many kernels have run;
* **communicator buffers**: NCCL allocates per communicator at its first collective, ~0.5-0.7
  GiB per process group on 4 NVLink A100s (NVIDIA/nccl#964: 544 MiB for 2 ranks, 688 MiB for
  more), linear in the channels used. A DHP rank uses three or four (the world, its module's
  inner and data-parallel groups, expert parallelism): ``COMM_GIB`` = 2. NVSwitch systems
  (``nvls``: H100/H200/H20/B200 HGX) add NVLink SHARP buffers, up to 2.25 GiB per communicator of
  8 ranks (``nvlsTotalSize 2415919104`` on 8 x H200, vllm-project/vllm#9699): ``NVLS_GIB`` = 1
  more assumes few of them at full size; ``NCCL_NVLS_ENABLE=0`` (as NeMo's launcher sets) frees
  it, a run keeping NVLS on many groups should raise the margin;
* **allocator fragmentation**, ``FRAGMENTATION`` = 4% of the memory: the caching allocator's
  rounded and split blocks, reserved but not allocated (``expandable_segments:True`` in
  ``PYTORCH_CUDA_ALLOC_CONF`` lowers it). A planned figure is allocated bytes; the GPU check
  (``benchmarks/gpu``) reports reserved next to allocated.

A run overrides the margin with ``scaling.device_margin_gib`` or ``--device-margin-gib``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Accelerator", "ACCELERATORS", "DEFAULT_GPU", "DeviceBudget", "accelerator",
           "budget_of"]

CONTEXT_GIB = 0.5
COMM_GIB = 2.0
NVLS_GIB = 1.0
FRAGMENTATION = 0.04


@dataclass(frozen=True)
class Accelerator:
    """One kind of device: ``name`` (run file, CLI), ``match`` (a substring of the CUDA device
    name), ``memory_gib`` (total as CUDA reports it), ``peak_bf16`` (dense FLOP/s), whether
    NCCL can use NVLink SHARP on it (``nvls``: NVSwitch HGX boards) and the links and memory
    bandwidth the pool planner (`ray_dhp.planning.pools`) prices it with."""

    name: str
    match: str
    memory_gib: float
    peak_bf16: float
    nvls: bool = False
    #: GB/s per device and direction NCCL/RCCL reaches inside a node (the table's comment)
    link_gbs: float = 360.0
    #: GB/s per device between nodes (the table's comment)
    internode_gbs: float = 45.0
    #: device memory bandwidth, TB/s (the optimizer update's time in the cost model)
    hbm_tbs: float = 3.35

    @property
    def margin_gib(self) -> float:
        """The default device margin (module docstring), to 0.1 GiB."""
        m = CONTEXT_GIB + COMM_GIB + (NVLS_GIB if self.nvls else 0.0) + FRAGMENTATION * self.memory_gib
        return round(m, 1)


#: Links (``link_gbs``, ``internode_gbs``), an assumption: NCCL's bus bandwidth is taken as 0.8 of the raw
#: per-direction link rate (NVLink 4: 450 GB/s raw -> 360, the cost model's default), not
#: measured here. Between nodes: one 400 Gb/s NIC per GPU on HGX/OAM boards (50 GB/s, ~45
#: reached), 200 Gb/s per GPU on A100 HGX (~22), and an assumed 100 Gb/s per GPU on PCIe-card
#: servers (L40S, L40, L4: ~11). A pool file replaces any of them (``link_gbs``, ``internode_gbs``).

#: The device table, in matching order (a longer name first: "H200" before "H20", "L40S" before
#: "L40" before "L4"). Peaks are *dense* bf16 tensor FLOP/s (datasheets print the 2:4-sparse
#: figure, twice as large, beside them). Sources, per row:
#: - H100 SXM 80 GB: NVIDIA H100 Tensor Core GPU datasheet: bf16 1,979 TFLOPS with sparsity
#:   (989 dense), HBM3 3.35 TB/s, NVLink 900 GB/s (450 per direction).
#: - H200 SXM 141 GB: NVIDIA H200 datasheet: bf16 1,979 sparse (989 dense), HBM3e 4.8 TB/s,
#:   NVLink 900 GB/s.
#: - H800 / A800: the export parts of H100 / A100 (NVIDIA product briefs): same compute and
#:   memory, NVLink 400 GB/s (200 per direction).
#: - H20 96 GB: NVIDIA HGX H20 product brief: bf16 148 TFLOPS dense, HBM3 4.0 TB/s, NVLink 900 GB/s.
#: - A100 SXM 80 GB / 40 GB: NVIDIA A100 datasheet: bf16 312 TFLOPS dense (624 sparse), HBM2e
#:   2,039 GB/s (80 GB) / HBM2 1,555 GB/s (40 GB), NVLink 3 600 GB/s (300 per direction).
#: - L40S 48 GB: NVIDIA L40S datasheet: bf16 362.05 TFLOPS dense (733 sparse), GDDR6 864 GB/s,
#:   no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional (32 per direction).
#: - L40 48 GB: NVIDIA L40 datasheet: bf16 181.05 TFLOPS dense (362.1 sparse), GDDR6 864 GB/s,
#:   PCIe Gen4 x16 (listed so that an L40 is not matched as an L4).
#: - L4 24 GB: NVIDIA L4 datasheet: bf16 242 TFLOPS with sparsity (121 dense), GDDR6 300 GB/s,
#:   PCIe Gen4 x16.
#: - B200 180 GB: NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS sparse per 8 GPUs (2.25 PF
#:   dense each), HBM3e 8 TB/s, NVLink 5 1.8 TB/s (900 per direction).
#: - MI300X 192 GB: AMD Instinct MI300X datasheet: bf16 1,307.4 TFLOPS dense (2,614.9 sparse),
#:   HBM3 5.3 TB/s, 7 Infinity Fabric links, 896 GB/s aggregate peer-to-peer (448 per direction).
#:   RCCL, not NCCL: ``nvls`` off; the context and communicator parts of the margin are NVIDIA's.
#: ``memory_gib`` is what the runtime reports, below the marketed GB (rounded; not measured here).
ACCELERATORS = {a.name: a for a in (
    Accelerator("h200", "H200", 139.8, 989e12, nvls=True, hbm_tbs=4.8),
    Accelerator("h100", "H100", 79.1, 989e12, nvls=True),      # SXM 80 GB
    Accelerator("h800", "H800", 79.1, 989e12, nvls=True, link_gbs=160.0),
    Accelerator("h20", "H20", 95.0, 148e12, nvls=True, hbm_tbs=4.0),
    Accelerator("a100-80gb", "A100", 79.1, 312e12, link_gbs=240.0, internode_gbs=22.0,
                hbm_tbs=2.039),
    Accelerator("a100-40gb", "A100", 39.4, 312e12, link_gbs=240.0, internode_gbs=22.0,
                hbm_tbs=1.555),
    Accelerator("a800", "A800", 79.1, 312e12, link_gbs=160.0, internode_gbs=22.0,
                hbm_tbs=2.039),
    Accelerator("l40s", "L40S", 44.4, 362e12, link_gbs=25.0, internode_gbs=11.0, hbm_tbs=0.864),
    Accelerator("l40", "L40", 44.4, 181.05e12, link_gbs=25.0, internode_gbs=11.0, hbm_tbs=0.864),
    Accelerator("l4", "L4", 22.5, 121e12, link_gbs=25.0, internode_gbs=11.0, hbm_tbs=0.3),
    Accelerator("b200", "B200", 178.4, 2250e12, nvls=True, link_gbs=720.0, hbm_tbs=8.0),
    Accelerator("mi300x", "MI300X", 191.7, 1307.4e12, link_gbs=358.0, hbm_tbs=5.3),
)}

#: What a GPU run plans for when its run file names no accelerator.
DEFAULT_GPU = "h100"


def accelerator(name: str, key: str = "scaling.accelerator") -> Accelerator:
    """The table's entry ``name``; ValueError naming ``key`` and the known names otherwise."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"{key}: unknown accelerator {name!r}; known: "
                         f"{', '.join(ACCELERATORS)}.") from None


@dataclass(frozen=True)
class DeviceBudget:
    """What a verdict compares a rank's planned peak with: ``memory_gib`` less ``margin_gib``."""

    name: str
    memory_gib: float
    margin_gib: float

    @property
    def usable_gib(self) -> float:
        return self.memory_gib - self.margin_gib

    def fits(self, nbytes: float) -> bool:
        return nbytes <= self.usable_gib * 2 ** 30

    def headroom(self, nbytes: float) -> float:
        """Fraction of the device's memory still free after ``nbytes`` and the margin."""
        return (self.usable_gib * 2 ** 30 - nbytes) / (self.memory_gib * 2 ** 30)

    def describe(self) -> str:
        return (f"device {self.name} {self.memory_gib:g} GiB less a {self.margin_gib:g} GiB "
                f"margin = {self.usable_gib:.4g} GiB for the plan")


def budget_of(name: Optional[str], memory_gib: Optional[float] = None,
              margin_gib: Optional[float] = None, margin_key: str = "--device-margin-gib",
              ) -> DeviceBudget:
    """The budget of accelerator ``name`` (None: `DEFAULT_GPU`), its memory replaced by
    ``memory_gib`` (``--device-gib``) and its margin by ``margin_gib`` where given; a replaced
    memory keeps the kind's margin rules (context, communicators, its fraction for
    fragmentation). ValueError naming ``margin_key`` if the margin is negative or leaves no
    memory."""
    acc = accelerator(name or DEFAULT_GPU)
    if memory_gib is not None:
        from dataclasses import replace

        acc = replace(acc, name=f"{acc.name} (--device-gib)", memory_gib=memory_gib)
    margin = acc.margin_gib if margin_gib is None else margin_gib
    if not 0 <= margin < acc.memory_gib:
        raise ValueError(f"{margin_key}: {margin:g} GiB must be >= 0 and below the device's "
                         f"{acc.memory_gib:g} GiB.")
    return DeviceBudget(acc.name, acc.memory_gib, margin)

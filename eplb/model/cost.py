"""What a layout costs in time: a roofline cost model of one MoE layer on one GPU, and of weight copies.

One MoE layer on one GPU serves ``tokens`` routed tokens (token-expert pairs) with ``active`` slots
that receive at least one of them. Its time is the roofline of two costs::

    compute = tokens * flops_per_token / flops                       (prefill: compute-bound)
    memory  = (active * expert_bytes + tokens * token_bytes) / hbm_bandwidth
                                                                     (decode: every activated slot's
                                                                      weights are read once)
    gpu_time = max(compute, memory) + layer_overhead_s               (regime="roofline")

``regime="compute"`` or ``"memory"`` keeps one of the two terms. A layer takes as long as its
slowest GPU; a step is the sum over layers. :meth:`CostModel.balanced_layer_time` is the time of
a GPU carrying the mean tokens and the mean activated slots (the same work spread evenly).
:func:`eplb.simulate` measures every run from one *perfectly balanced* time that does not depend on
the placement or the dispatch: the layer's tokens and its activated experts (each read once, as
with one replica) spread evenly over the GPUs, so ``step time - balanced time`` is the time lost to
imbalance and to replicas' extra reads, comparable between runs.

Weight copies (see :class:`eplb.TransferPlan`) move ``expert_bytes`` each: over NVLink inside a node,
over the network (one NIC per GPU) between nodes, or within one GPU's HBM (read + write). A GPU's
copy time is the slowest of its three engines, each carrying the larger of what the GPU sends and
receives on it; a rebalance's copy time is the slowest GPU's. ``copy_mode`` says what the engine
does meanwhile: ``"stall"`` (rearranges synchronously: serving waits for the copies), ``"overlap"``
(copies run beside serving; the new placement serves once they are done) or ``"free"`` (no cost:
the reference).

Presets (:data:`HARDWARE`, :data:`MODELS`, :meth:`CostModel.preset`); peak figures, dense (no
sparsity), from:

- H100 SXM: NVIDIA H100 Tensor Core GPU datasheet: HBM3 3.35 TB/s, BF16 989 TFLOP/s, FP8
  1,979 TFLOP/s, NVLink 900 GB/s (both directions: 450 GB/s each way).
- H200 SXM: NVIDIA H200 datasheet: HBM3e 4.8 TB/s; same Hopper tensor cores and NVLink as H100.
- H20: NVIDIA HGX H20 product brief: HBM3 4.0 TB/s, BF16 148 TFLOP/s, FP8 296 TFLOP/s, NVLink
  900 GB/s.
- B200 (HGX, 1000 W): NVIDIA HGX B200 / DGX B200 datasheets: HBM3e 8 TB/s, BF16 2.25 PFLOP/s,
  FP8 4.5 PFLOP/s, NVLink 5 1.8 TB/s (900 GB/s each way).
- Network: one 400 Gb/s InfiniBand NIC (ConnectX-7) per GPU as in DGX H100/H200/B200: 50 GB/s.
- DeepSeek-V3: ``deepseek-ai/DeepSeek-V3`` config.json: hidden_size 7168, moe_intermediate_size
  2048, n_routed_experts 256, num_experts_per_tok 8, 61 layers of which the first 3 dense
  (first_k_dense_replace) -> 58 MoE layers; FP8 weights (1 byte per parameter; block scales ignored).
- Mixtral-8x7B: ``mistralai/Mixtral-8x7B-v0.1`` config.json: hidden_size 4096, intermediate_size
  14336, 8 local experts, top-2, 32 layers; BF16.
- gpt-oss-20b: ``openai/gpt-oss-20b`` config.json: hidden_size 2880, intermediate_size 2880,
  32 local experts, 4 per token, 24 layers; MoE weights in MXFP4 (4-bit values plus one 8-bit scale
  per 32: 4.25 bits per parameter).
- OLMoE-1B-7B: ``allenai/OLMoE-1B-7B-0924`` config.json: hidden_size 2048, intermediate_size 1024,
  64 experts, 8 per token, 16 layers; BF16.

An expert is three matrices (gate, up, down) of ``hidden x intermediate``: ``3 * h * i`` parameters
and ``2 * 3 * h * i`` FLOPs per routed token. A routed token also moves its activations through
HBM: the input and output rows (``2 h``) and the intermediate (gate, up, activated: ``3 i``) in BF16.
Achievable rates are the peaks times ``compute_efficiency`` (0.6), ``memory_efficiency`` (0.8) and
``link_efficiency`` (0.8) unless overridden; every field can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

REGIMES = ("roofline", "compute", "memory")
COPY_MODES = ("stall", "overlap", "free")


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one GPU (dense, no sparsity). Bandwidths in bytes/s per direction."""

    name: str
    hbm_bandwidth: float
    flops_bf16: float
    flops_fp8: float
    nvlink_bandwidth: float
    network_bandwidth: float
    host_bandwidth: float = 0.0  # host memory to one GPU (PCIe), bytes/s; 0: PCIE_GEN5


@dataclass(frozen=True)
class MoEModel:
    """The MoE part of a model: its expert shape, routing and weight format."""

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    bytes_per_param: float
    precision: str  # "fp8" or "bf16": the tensor-core rate its expert GEMMs run at
    activation_bytes: float = 2.0  # bytes per activation value (BF16)
    first_dense_layers: int = 0  # dense layers before the MoE ones (DeepSeek-V3's first_k_dense_replace)

    @property
    def num_layers(self) -> int:
        """Every layer of the model (``num_hidden_layers``): the dense ones first, then the MoE ones."""
        return self.first_dense_layers + self.num_moe_layers

    @property
    def moe_layer_ids(self) -> np.ndarray:
        """``[num_moe_layers]`` int64: the model's index of each MoE layer (DeepSeek-V3: 3 .. 60)."""
        return np.arange(self.first_dense_layers, self.num_layers, dtype=np.int64)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.bytes_per_param

    @property
    def flops_per_token(self) -> float:
        """FLOPs of one routed token in one expert (a multiply-add is 2)."""
        return 2.0 * self.expert_params

    @property
    def token_bytes(self) -> float:
        """HBM bytes one routed token moves besides the weights (input, output, intermediates)."""
        return (2 * self.hidden_size + 3 * self.moe_intermediate_size) * self.activation_bytes


TB, GB, TFLOP = 1e12, 1e9, 1e12
NIC_400G = 50 * GB
PCIE_GEN5 = 64 * GB  # x16, per direction: every preset GPU's link to host memory

HARDWARE = {
    "H100": Hardware("H100 SXM", 3.35 * TB, 989 * TFLOP, 1979 * TFLOP, 450 * GB, NIC_400G),
    "H200": Hardware("H200 SXM", 4.8 * TB, 989 * TFLOP, 1979 * TFLOP, 450 * GB, NIC_400G),
    "H20": Hardware("H20", 4.0 * TB, 148 * TFLOP, 296 * TFLOP, 450 * GB, NIC_400G),
    "B200": Hardware("B200 SXM", 8.0 * TB, 2250 * TFLOP, 4500 * TFLOP, 900 * GB, NIC_400G),
}

MODELS = {
    "deepseek-v3": MoEModel("DeepSeek-V3", 7168, 2048, 256, 8, 58, 1.0, "fp8", first_dense_layers=3),
    "mixtral-8x7b": MoEModel("Mixtral-8x7B", 4096, 14336, 8, 2, 32, 2.0, "bf16"),
    "gpt-oss-20b": MoEModel("gpt-oss-20b", 2880, 2880, 32, 4, 24, 4.25 / 8, "bf16"),
    "olmoe-1b-7b": MoEModel("OLMoE-1B-7B", 2048, 1024, 64, 8, 16, 2.0, "bf16"),
}


def _positive(value, name: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    return value


@dataclass(frozen=True)
class CostModel:
    """Time of MoE layers and of expert-weight copies on one kind of GPU (all rates achievable).

    Attributes:
        expert_bytes: bytes of one expert's weights in one layer.
        flops_per_token: FLOPs one routed token costs in one expert.
        token_bytes: HBM bytes one routed token moves besides the weights.
        flops: achievable FLOP/s of one GPU for the expert GEMMs.
        hbm_bandwidth: achievable HBM bytes/s of one GPU.
        nvlink_bandwidth: achievable NVLink bytes/s per GPU per direction.
        network_bandwidth: achievable network bytes/s per GPU per direction (inter-node).
        host_bandwidth: achievable bytes/s from host memory to one GPU (PCIe): how fast an expert
            whose every replica was lost is loaded again (:meth:`transfer_time`).
        layer_overhead_s: fixed time per MoE layer and GPU (kernel launches), added to every GPU.
        regime: ``"roofline"`` (max of compute and memory), ``"compute"`` or ``"memory"``.
        copy_mode: ``"stall"``, ``"overlap"`` or ``"free"`` (see the module docstring).
        name: a label.
    """

    expert_bytes: float
    flops_per_token: float
    token_bytes: float
    flops: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    layer_overhead_s: float = 0.0
    regime: str = "roofline"
    copy_mode: str = "stall"
    name: str = "custom"
    host_bandwidth: float = PCIE_GEN5 * 0.8

    def __post_init__(self):
        for name in ("expert_bytes", "flops_per_token", "token_bytes", "layer_overhead_s"):
            object.__setattr__(self, name, _positive(getattr(self, name), name, allow_zero=True))
        for name in ("flops", "hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth", "host_bandwidth"):
            object.__setattr__(self, name, _positive(getattr(self, name), name))
        for top, bottom in (("flops_per_token", "flops"), ("token_bytes", "hbm_bandwidth"),
                            ("expert_bytes", "hbm_bandwidth"), ("expert_bytes", "nvlink_bandwidth"),
                            ("expert_bytes", "network_bandwidth"), ("expert_bytes", "host_bandwidth")):
            with np.errstate(over="ignore"):
                ratio = getattr(self, top) / getattr(self, bottom)
            if not np.isfinite(ratio):
                raise ValueError(f"{top} / {bottom} must be finite (seconds per unit), got "
                                 f"{getattr(self, top)!r} / {getattr(self, bottom)!r}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {self.regime!r}")
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode must be one of {COPY_MODES}, got {self.copy_mode!r}")

    @classmethod
    def preset(cls, hardware: str | Hardware = "H100", model: str | MoEModel = "deepseek-v3", *,
               precision: str | None = None, compute_efficiency: float = 0.6, memory_efficiency: float = 0.8,
               link_efficiency: float = 0.8, **overrides) -> "CostModel":
        """A cost model from :data:`HARDWARE` and :data:`MODELS` (or your own :class:`Hardware` /
        :class:`MoEModel`), peaks scaled by the efficiencies; ``overrides`` set any field.

        Args:
            precision: ``"fp8"`` or ``"bf16"`` tensor-core rate (default: the model's).
        """
        hw = _lookup(HARDWARE, hardware, Hardware, "hardware")
        mo = _lookup(MODELS, model, MoEModel, "model")
        precision = mo.precision if precision is None else precision
        if precision not in ("fp8", "bf16"):
            raise ValueError(f"precision must be 'fp8' or 'bf16', got {precision!r}")
        efficiency = {}
        for name, value in (("compute_efficiency", compute_efficiency), ("memory_efficiency", memory_efficiency),
                            ("link_efficiency", link_efficiency)):
            value = _positive(value, name)
            if value > 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
            efficiency[name] = value
        peak = hw.flops_fp8 if precision == "fp8" else hw.flops_bf16
        values = dict(
            expert_bytes=mo.expert_bytes, flops_per_token=mo.flops_per_token, token_bytes=mo.token_bytes,
            flops=peak * efficiency["compute_efficiency"],
            hbm_bandwidth=hw.hbm_bandwidth * efficiency["memory_efficiency"],
            nvlink_bandwidth=hw.nvlink_bandwidth * efficiency["link_efficiency"],
            network_bandwidth=hw.network_bandwidth * efficiency["link_efficiency"],
            host_bandwidth=(hw.host_bandwidth or PCIE_GEN5) * efficiency["link_efficiency"],
            name=f"{mo.name} on {hw.name}",
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; fields are {sorted(known)}")
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes) -> "CostModel":
        """A copy with some fields changed (e.g. ``copy_mode="free"``)."""
        return replace(self, **changes)

    # -- layers ----------------------------------------------------------------------------------
    def gpu_time(self, tokens, active) -> np.ndarray:
        """Seconds one GPU spends on one MoE layer; ``tokens`` and ``active`` broadcast (any shape)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        active = np.asarray(active, dtype=np.float64)
        compute = tokens * (self.flops_per_token / self.flops)
        memory = (active * self.expert_bytes + tokens * self.token_bytes) / self.hbm_bandwidth
        if self.regime == "compute":
            time = compute
        elif self.regime == "memory":
            time = memory
        else:
            time = np.maximum(compute, memory)
        return time + self.layer_overhead_s

    def layer_time(self, tokens, active) -> np.ndarray:
        """``[..., G] -> [...]``: a layer waits for its slowest GPU."""
        return self.gpu_time(tokens, active).max(axis=-1)

    def balanced_layer_time(self, tokens, active) -> np.ndarray:
        """``[..., G] -> [...]``: the layer's time with its tokens and activated slots spread evenly
        over the ``G`` GPUs given (pass only GPUs that hold slots)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        active = np.asarray(active, dtype=np.float64)
        return self.gpu_time(tokens.mean(axis=-1), active.mean(axis=-1))

    def step_time(self, tokens, active) -> np.ndarray:
        """``[..., L, G] -> [...]``: the sum over layers of the slowest GPU."""
        return self.layer_time(tokens, active).sum(axis=-1)

    # -- copies ----------------------------------------------------------------------------------
    def copy_time(self, local, intra_node, cross_node) -> float:
        """Seconds a set of weight copies takes.

        Args:
            local: ``[G]`` copies within each GPU's HBM (each reads and writes ``expert_bytes``).
            intra_node, cross_node: ``[G]`` per GPU, the larger of the copies it sends and receives
                over NVLink / the network.
        """
        local, intra_node, cross_node = (np.asarray(a, dtype=np.float64) for a in (local, intra_node, cross_node))
        per_gpu = np.maximum.reduce([
            local * (2 * self.expert_bytes / self.hbm_bandwidth),
            intra_node * (self.expert_bytes / self.nvlink_bandwidth),
            cross_node * (self.expert_bytes / self.network_bandwidth),
        ])
        return float(per_gpu.max()) if per_gpu.size else 0.0

    def transfer_time(self, transfer) -> float:
        """Seconds the copies of a :class:`eplb.TransferPlan` take (all layers at once), in the
        plan's order (:attr:`eplb.TransferPlan.phase`): the copies between GPUs that read the
        placement in service, then the loads from host memory (each GPU's at ``host_bandwidth``),
        then the copies that read a loaded slot. Without a change, only the first step."""
        num_gpus = transfer.topology.num_gpus
        phase = transfer.phase
        loads = np.bincount(transfer.dst_gpu[phase == 1], minlength=num_gpus)  # step 1: from host memory
        host = float(loads.max()) * self.expert_bytes / self.host_bandwidth if loads.size else 0.0
        return self._gpu_copy_time(transfer, phase == 0) + host + self._gpu_copy_time(transfer, phase == 2)

    def _gpu_copy_time(self, transfer, step: np.ndarray) -> float:
        """:meth:`copy_time` of the copies of ``transfer`` in ``step`` (``[C]`` bool)."""
        if not step.any():
            return 0.0
        num_gpus = transfer.topology.num_gpus
        per_kind = []
        for kind in range(3):
            keep = step & (transfer.kind == kind)
            sends = np.bincount(transfer.src_gpu[keep], minlength=num_gpus)
            receives = np.bincount(transfer.dst_gpu[keep], minlength=num_gpus)
            per_kind.append(receives if kind == 0 else np.maximum(sends, receives))
        return self.copy_time(*per_kind)

    def replica_bytes(self, num_slots: int, num_experts: int, num_layers: int) -> float:
        """HBM bytes the redundant replicas take in all (``(S - E) * L`` expert weights)."""
        return float(max(num_slots - num_experts, 0) * num_layers * self.expert_bytes)


def crossing_cost(off_node_tokens, num_gpus: int, cost: CostModel, model: MoEModel) -> dict:
    """What tokens served off their home node cost on the network (racks as nodes: off the rack).

    A token served on another node sends its hidden state there and receives the expert's output
    back: ``2 * hidden_size * activation_bytes`` bytes over the network instead of NVLink.

    Args:
        off_node_tokens: tokens (token-expert pairs) served off home, any shape (e.g. ``[L]``).
        num_gpus: ``G``, the GPUs whose NICs carry them (the all-to-all spreads them over all).
        cost: the :class:`CostModel` (its ``network_bandwidth`` and ``nvlink_bandwidth`` per GPU).
        model: the :class:`MoEModel` (its ``hidden_size`` and ``activation_bytes``).
    Returns:
        ``bytes_per_token``, ``bytes`` (the same shape as ``off_node_tokens``), ``network_s``: the
        seconds those bytes take on the network spread over ``G`` NICs, and ``extra_s``: that less
        the seconds over NVLink (what crossing adds, with the all-to-all bound by bandwidth).
    """
    tokens = np.asarray(off_node_tokens, dtype=np.float64)
    if not np.isfinite(tokens).all() or (tokens < 0).any():
        raise ValueError("off_node_tokens must be finite and non-negative")
    if int(num_gpus) != num_gpus or num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    per_token = 2.0 * model.hidden_size * model.activation_bytes
    moved = tokens * per_token
    network = moved / (num_gpus * cost.network_bandwidth)
    return {"bytes_per_token": per_token, "bytes": moved, "network_s": network,
            "extra_s": network - moved / (num_gpus * cost.nvlink_bandwidth)}


def _lookup(table: dict, key, kind: type, name: str):
    if isinstance(key, kind):
        return key
    if not isinstance(key, str) or key.lower() not in {k.lower() for k in table}:
        raise ValueError(f"{name} must be one of {sorted(table)} or a {kind.__name__}, got {key!r}")
    return next(v for k, v in table.items() if k.lower() == key.lower())


__all__ = ["CostModel", "Hardware", "MoEModel", "HARDWARE", "MODELS", "REGIMES", "COPY_MODES", "crossing_cost"]

"""Decoder-only GPT transformer (pre-LayerNorm, causal SDPA attention, tied lm_head).

Also owns which attention kernel it asks for (model.attention), how its head's loss is taken
(model.head_loss), which blocks recompute their activations in backward
(model.activation_checkpointing), and its analytic training-FLOP count, the PaLM / nanoGPT MFU
formula.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from mgpu.models.fused_loss import linear_cross_entropy
from mgpu.models.loss import cross_entropy

# model.attention -> the SDPA kernels allowed, in the order they are tried. `auto` puts cuDNN's
# fused attention first, then torch's own order. On one H100 (torch 2.11, cuDNN 9.19) GPT-2-
# small's eager forward and backward took 50.2 ms a step with cuDNN's kernels against 51.8 ms
# with FlashAttention-2 (B=16, T=1024, 64-wide heads; torch 2.11 picks cuDNN there by itself);
# auto keeps that choice whatever order a torch release prefers, and where cuDNN can't run the
# inputs (no GPU, an older GPU or cuDNN) the next kernel runs, as torch would have chosen it.
# `torch` leaves the choice to torch; a named kernel is the only one allowed (torch raises if
# it can't run).
ATTENTION = {
    "auto": [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ],
    "torch": None,  # torch's own choice, untouched
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}
# Named kernels that have no CPU implementation (torch 2.13: on a CPU tensor only flash and math
# run): refused before a CPU run starts, not met as torch's traceback in the first forward.
CUDA_ONLY_ATTENTION = ("cudnn", "efficient")

# model.head_loss: how forward(idx, targets) takes the loss. fused: the head's matrix multiply
# and the cross-entropy as one step that never keeps the logits (mgpu.models.fused_loss);
# logits: through the logits, as F.cross_entropy takes them; auto: fused on a GPU, logits
# elsewhere (on a CPU the fused step has no kernel of its own to gain from) and where a
# whole-model compile is known to miscompile the fused step (FUSED_HEAD_MAX_COMPILED_WIDTH).
HEAD_LOSS = ("auto", "fused", "logits")

# model.residual: the dtype of the residual stream between blocks. fp32: the embeddings' dtype,
# kept by autocast (a block's outputs are bf16 but add onto an fp32 stream); autocast: cast to
# the autocast dtype after the embeddings, so the stream, its LayerNorm inputs and its gradient
# are bf16 (LayerNorm still computes in fp32, as autocast runs it).
RESIDUAL = ("fp32", "autocast")

# The widest GPT whose fused head loss a whole-model compile computes as the eager model does
# under autocast with the fp32 residual stream. Wider, torch's inductor (torch 2.11 on the GPU
# machine; torch 2.13's code generator is the same) fuses the last residual add, ln_f and the
# cast for the head into one looped reduction kernel that stores the normalised rows in one loop
# and reads them back in a later one without a barrier between the threads that wrote and read
# them: a race. The compiled loss then differs from eager's from the first step (GPT-2 XL on one
# H200: 5.847 against 5.856, and differently from one run to the next), the head's gradient by
# 2-4 % at once and by more as training goes on, and GPT-2 XL stalled near a training loss of
# 3.3 where eager training reached 2.8 (bench/README.md, "The fp32-stream loss finding"). At 1024
# channels and below inductor keeps a row in registers (a persistent reduction: no loops) and
# the compiled step matched eager; the bf16 stream, fp32 training and the logits head matched at
# every width measured. pytorch/pytorch#190519 adds the barrier upstream.
FUSED_HEAD_MAX_COMPILED_WIDTH = 1024


def fused_head_miscompiles(n_embd: int, residual: str, autocast: bool) -> bool:
    """Whether a whole-model compile of the fused head loss is known to compute a wrong loss
    (FUSED_HEAD_MAX_COMPILED_WIDTH says where and why)."""
    return autocast and residual == "fp32" and n_embd > FUSED_HEAD_MAX_COMPILED_WIDTH


def takes_fused_head(head_loss: str, on_gpu: bool, compiling: bool, miscompiles: bool) -> bool:
    """model.head_loss resolved for one forward: `fused` always; `auto` on a GPU unless the
    forward is being compiled into a graph known to miscompile the fused head (there the
    logits' loss, which compiles correctly, whatever the backend: forward cannot tell which;
    build_run says so under inductor, where a `fused` run stops before it starts)."""
    if head_loss == "fused":
        return True
    return head_loss == "auto" and on_gpu and not (compiling and miscompiles)


def checkpointed_blocks(setting: str | int, n_layer: int) -> int:
    """How many blocks, from the first, model.activation_checkpointing recomputes: none (0),
    blocks (all of them) or a number from 0 to n_layer."""
    if setting == "none":
        return 0
    if setting == "blocks":
        return n_layer
    if isinstance(setting, int) and not isinstance(setting, bool) and 0 <= setting <= n_layer:
        return setting
    raise ValueError(
        f"activation_checkpointing={setting!r}: must be none, blocks, or a number of blocks "
        f"from 0 to n_layer ({n_layer})"
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, attention: str):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.kernels = ATTENTION[attention]
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): SDPA wants heads as a batch dim
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if self.kernels is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            # torch.compile records the choice in the graph: compiled code runs the same kernel.
            with sdpa_kernel(self.kernels, set_priority=True):
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float,
        bias: bool,
        attention: str,
        checkpointed: bool = False,
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, attention)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = FeedForward(n_embd, dropout, bias)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            # Keeps only the block's input; backward runs its forward again for the rest.
            # Non-reentrant: the recomputed forward feeds the one backward pass, so each
            # parameter's gradient is accumulated (and mgpu's reducer hook fires) once, as
            # without checkpointing; the reentrant kind runs a backward of its own, whose end
            # the reducer would take for the step's (mgpu.comm.reducer). Dropout masks are drawn
            # again from the RNG state saved here (preserve_rng_state), so the recomputed
            # activations are the first ones, bit for bit. Inside forward, so that a compiled
            # block traces the checkpoint with it and stays one compiled region.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        bias: bool = False,
        attention: str = "auto",
        head_loss: str = "auto",
        activation_checkpointing: str | int = "none",
        residual: str = "fp32",
    ):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(
                f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): "
                "each head gets n_embd // n_head channels"
            )
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: must be one of {', '.join(ATTENTION)}")
        if head_loss not in HEAD_LOSS:
            raise ValueError(f"head_loss={head_loss!r}: must be one of {', '.join(HEAD_LOSS)}")
        if residual not in RESIDUAL:
            raise ValueError(f"residual={residual!r}: must be one of {', '.join(RESIDUAL)}")
        self.head_loss = head_loss
        self.residual = residual
        # The first `checkpointed` blocks keep only their input for backward (Block.forward).
        self.checkpointed = checkpointed_blocks(activation_checkpointing, n_layer)
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, dropout, bias, attention, checkpointed=i < self.checkpointed)
            for i in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # weight tying: one matrix embeds tokens and scores them (saves vocab*n_embd params)
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: scale residual-branch outputs so the residual stream's variance does not
        # grow with depth (2 residual adds per layer)
        resid_std = 0.02 / math.sqrt(2 * self.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=resid_std)

    # The Trainer calls forward(inputs, targets) and takes the loss it returns.
    computes_loss = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [B, T, V]; with `targets` [B, T], the mean cross-entropy instead."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        if self.residual == "autocast" and torch.is_autocast_enabled(x.device.type):
            # model.residual=autocast: from here on the stream and its gradient are bf16 / fp16;
            # the embeddings' sum is still taken in fp32. Without autocast (fp32 training,
            # sampling) there is no lower dtype to take, and the stream stays as it is.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        device = x.device.type
        miscompiles = fused_head_miscompiles(
            self.n_embd, self.residual, torch.is_autocast_enabled(device)
        )
        if takes_fused_head(self.head_loss, x.is_cuda, torch.compiler.is_compiling(), miscompiles):
            return linear_cross_entropy(x, self.lm_head.weight, targets)
        return cross_entropy(self.lm_head(x), targets)

    def num_params(self) -> int:
        # parameters() de-duplicates, so the tied wte/lm_head weight counts once
        return sum(p.numel() for p in self.parameters())

    def flops_per_sample(self, sample_shape: tuple[int, ...]) -> float:
        """Training FLOPs (fwd + bwd) for one sequence of length sample_shape[0].

        PaLM appendix B / nanoGPT: 6*N per token for the weight matmuls plus 12*L*d*T per
        token for attention scores and values. N excludes wpe (a lookup, no matmul); the
        tied wte counts once, as lm_head. LayerNorm/softmax/GELU are ignored, and so are the
        forwards that activation checkpointing runs again (MFU counts the model's FLOPs, not
        the hardware's).
        """
        T = sample_shape[0]
        n = self.num_params() - self.wpe.weight.numel()
        return float((6 * n + 12 * self.n_layer * self.n_embd * T) * T)

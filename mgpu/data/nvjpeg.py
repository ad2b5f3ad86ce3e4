"""nvJPEG's hardware decoder called directly (ctypes), on a CUDA stream that mgpu chooses: the
decode step of data.decode=gpu on GPUs with JPEG engines (A100, H100, H200).

Why not torchvision's decode_jpeg, which uses the same engines: it runs nvJPEG on a stream of
its own at the lowest priority, and nvJPEG finishes each image with a small colour-conversion
kernel there. Beside a training step those ~128 kernels a batch wait, one after another, for
SMs that the step's queued kernels keep taking (a batch decoded 9x slower beside a convolution
loop than alone, whatever the priority of mgpu's own stream; bench/README.md, real_images), so
the copy thread fell behind and the step waited for data. Here the whole decode is queued on
the caller's stream (the prefetcher's, at the highest priority), and nvJPEG's buffers come from
torch's caching allocators: nvJPEG's own cudaFree and cudaFreeHost would each wait for the whole
device.

The library is found where torch's CUDA wheels or the system put it (`libnvjpeg.so.<major>`).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import torch
from torch import Tensor

BACKEND_HARDWARE = 3  # nvjpegBackend_t
OUTPUT_RGB = 3  # nvjpegOutputFormat_t: planar R, G, B
STATUS = {
    1: "not initialized",
    2: "invalid parameter",
    3: "bad JPEG",
    4: "JPEG not supported",
    5: "allocator failure",
    6: "execution failed",
    7: "no JPEG hardware on this GPU",
    8: "internal error",
    9: "not implemented",
    10: "incomplete bitstream",
}
MAX_COMPONENTS = 4


class NvjpegError(RuntimeError):
    """An nvJPEG call that failed: the call and nvJPEG's reason."""


class _Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [
        ("channel", ctypes.c_void_p * MAX_COMPONENTS),
        ("pitch", ctypes.c_size_t * MAX_COMPONENTS),
    ]


_DevMalloc = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
_DevFree = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_PinnedMalloc = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint
)


class _DevAllocator(ctypes.Structure):  # nvjpegDevAllocator_t
    _fields_ = [("dev_malloc", _DevMalloc), ("dev_free", _DevFree)]


class _PinnedAllocator(ctypes.Structure):  # nvjpegPinnedAllocator_t
    _fields_ = [("pinned_malloc", _PinnedMalloc), ("pinned_free", _DevFree)]


def _candidates() -> list[str]:
    """Where libnvjpeg may be: the nvidia-* wheels beside torch (CUDA 13's nvidia/cu13/lib,
    CUDA 12's nvidia/nvjpeg/lib), torch's own lib folder, then the loader's search path."""
    major = (torch.version.cuda or "0").split(".")[0]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = []
    for root in [*sys.path, cuda_home]:
        for sub in ("nvidia/cu*/lib", "nvidia/nvjpeg/lib", "torch/lib", "lib64"):
            found += sorted(glob.glob(os.path.join(root, sub, f"libnvjpeg.so.{major}*")))
    return [*found, f"libnvjpeg.so.{major}", "libnvjpeg.so"]


def load_library() -> ctypes.CDLL:
    """libnvjpeg of torch's CUDA major version; NvjpegError naming where it looked."""
    tried = _candidates()
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise NvjpegError(f"libnvjpeg not found (looked for {', '.join(tried[-2:])} and wheels)")


class HardwareDecoder:
    """Decodes batches of baseline JPEGs with the GPU's JPEG engines into uint8 [3, H, W]
    tensors, all of its GPU work queued on the current stream of the calling thread.

    One decode at a time (a lock): the nvJPEG state holds one batch. Stream rule: the outputs
    and nvJPEG's buffers are allocated on the calling stream and written there; the caller
    keeps the JPEG bytes (pinned, for asynchronous copies) alive until that stream has run the
    decode, as the prefetcher's pinned-buffer rule does for the batch they came in.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.lib = load_library()
        self._lock = threading.Lock()
        self._pinned: dict[int, Tensor] = {}
        # The callbacks must live as long as the handle: nvJPEG calls them at any decode.
        self._callbacks = (
            _DevMalloc(self._dev_malloc),
            _DevFree(self._dev_free),
            _PinnedMalloc(self._pinned_malloc),
            _DevFree(self._pinned_free),
        )
        self._dev = _DevAllocator(self._callbacks[0], self._callbacks[1])
        self._host = _PinnedAllocator(self._callbacks[2], self._callbacks[3])
        self.handle, self.state = ctypes.c_void_p(), ctypes.c_void_p()
        self.stream_handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._call(
                "nvjpegCreateEx",
                BACKEND_HARDWARE,
                ctypes.byref(self._dev),
                ctypes.byref(self._host),
                0,
                ctypes.byref(self.handle),
            )
            self._call("nvjpegJpegStateCreate", self.handle, ctypes.byref(self.state))
            self._call("nvjpegJpegStreamCreate", self.handle, ctypes.byref(self.stream_handle))

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise NvjpegError(f"{name}: {STATUS.get(status, f'status {status}')}")

    # nvJPEG's buffers from torch's allocators (see the module docstring): memory freed here
    # returns to torch's caches in stream order instead of through a device-wide sync.
    def _dev_malloc(self, out, size: int) -> int:
        stream = torch.cuda.current_stream(self.device)
        out[0] = torch.cuda.caching_allocator_alloc(max(size, 1), self.device, stream)
        return 0

    def _dev_free(self, ptr) -> int:
        if ptr:
            torch.cuda.caching_allocator_delete(ptr)
        return 0

    def _pinned_malloc(self, out, size: int, flags: int) -> int:
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
        self._pinned[buffer.data_ptr()] = buffer
        out[0] = buffer.data_ptr()
        return 0

    def _pinned_free(self, ptr) -> int:
        self._pinned.pop(ptr, None)
        return 0

    def supported(self, data: Tensor) -> bool:
        """Whether the engines take this JPEG (baseline Huffman, a subsampling they know)."""
        with self._lock:
            pointer = ctypes.c_void_p(data.data_ptr())
            self._call(
                "nvjpegJpegStreamParseHeader",
                self.handle,
                pointer,
                ctypes.c_size_t(data.numel()),
                self.stream_handle,
            )
            answer = ctypes.c_int(-1)
            self._call(
                "nvjpegDecodeBatchedSupported",
                self.handle,
                self.stream_handle,
                ctypes.byref(answer),
            )
            return answer.value == 0

    def __call__(self, jpegs: list[Tensor]) -> list[Tensor]:
        """[3, H, W] uint8 images on the device, on the current stream."""
        with self._lock, torch.cuda.device(self.device):
            n = len(jpegs)
            outputs, images = [], (_Image * n)()
            components, subsampling = ctypes.c_int(), ctypes.c_int()
            widths, heights = (ctypes.c_int * MAX_COMPONENTS)(), (ctypes.c_int * MAX_COMPONENTS)()
            for k, data in enumerate(jpegs):
                self._call(
                    "nvjpegGetImageInfo",
                    self.handle,
                    ctypes.c_void_p(data.data_ptr()),
                    ctypes.c_size_t(data.numel()),
                    ctypes.byref(components),
                    ctypes.byref(subsampling),
                    widths,
                    heights,
                )
                h, w = heights[0], widths[0]
                out = torch.empty(3, h, w, dtype=torch.uint8, device=self.device)
                for c in range(3):
                    images[k].channel[c] = out[c].data_ptr()
                    images[k].pitch[c] = w
                outputs.append(out)
            pointers = (ctypes.c_void_p * n)(*[d.data_ptr() for d in jpegs])
            lengths = (ctypes.c_size_t * n)(*[d.numel() for d in jpegs])
            stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
            self._call("nvjpegDecodeBatchedInitialize", self.handle, self.state, n, 1, OUTPUT_RGB)
            self._call(
                "nvjpegDecodeBatched", self.handle, self.state, pointers, lengths, images, stream
            )
            return outputs

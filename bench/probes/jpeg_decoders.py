"""GPU JPEG decoders side by side, as data.decode=gpu would call them (101 JPEGs a call, planar
RGB on a side stream): torchvision's nvJPEG decode_jpeg, and nvImageCodec (NVIDIA's
nvidia-nvimgcodec-cu13 with nvidia-nvjpeg) with its backends chosen several ways. For each: the
largest and mean pixel difference from torchvision's decode on six JPEGs, whether it decodes a
progressive JPEG, ms a call of 101 JPEGs, and how long other threads' launches are held while
it decodes back to back on a thread (launches of a small kernel timed on the main thread for 4 s,
run-ahead bounded as launch_stalls.py does).

    python bench/probes/jpeg_decoders.py

All decoders share one process (nvImageCodec's decoders and their thread pools stay alive while
the next is timed). Prints one line a decoder and writes bench/results/jpeg_decoders-<device>-
<time>.json.
"""

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from nvidia import nvimgcodec as nv
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.make_image_folder import photo_like

    dev = torch.device("cuda", 0)

    def encoded(seed: int, **save) -> torch.Tensor:
        buf = io.BytesIO()
        Image.fromarray(photo_like(seed, 500, 375)).save(buf, format="JPEG", quality=90, **save)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    datas = [encoded(seed) for seed in range(6)]
    progressive = encoded(9, progressive=True)

    def make(backends, threads: int = 4, options: str = ""):  # noqa: ANN001
        decoder = nv.Decoder(
            device_id=0, max_num_cpu_threads=threads, backends=backends, options=options
        )
        params = nv.DecodeParams(
            apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
            sample_format=nv.SampleFormat.P_RGB,
        )  # fmt: skip

        def decode(data: list[torch.Tensor]) -> list:
            stream = torch.cuda.current_stream(dev).cuda_stream
            sources = [nv.CodeStream(t.numpy()) for t in data]
            images = decoder.decode(sources, params=params, cuda_stream=stream)
            return [None if i is None else torch.from_dlpack(i) for i in images]

        return decode

    def held_while(decode, seconds: float = 4.0) -> dict:  # noqa: ANN001
        stop, count = threading.Event(), [0]
        many = [datas[k % 6] for k in range(101)]

        def work() -> None:
            side = torch.cuda.Stream(dev)
            while not stop.is_set():
                with torch.cuda.stream(side):
                    decode(many)
                count[0] += 1

        x = torch.zeros(1024, device=dev)
        for _ in range(256):
            x.add_(1)
        torch.cuda.synchronize()
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        time.sleep(1.0)
        launches: list[float] = []
        marks: list[torch.cuda.Event] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(256):
                began = time.perf_counter()
                x.add_(1)
                launches.append((time.perf_counter() - began) * 1e3)
            mark = torch.cuda.Event()
            mark.record()
            marks.append(mark)
            if len(marks) > 2:
                marks.pop(0).synchronize()
        stop.set()
        thread.join(30)
        held = [t for t in launches if t > 1.0]
        return {"held_ms": sum(held), "held": len(held), "longest_ms": max(launches),
                "calls": count[0], "of_ms": seconds * 1e3}  # fmt: skip

    def torchvision(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=dev)

    ref = torchvision(datas)
    torch.cuda.synchronize()
    configs = {
        "default": (None, 4, ""),
        "HW": ([nv.Backend(nv.HW_GPU_ONLY)], 4, ""),
        "HW+HYBRID": ([nv.Backend(nv.HW_GPU_ONLY), nv.Backend(nv.HYBRID_CPU_GPU)], 4, ""),
        "HW+GPU": ([nv.Backend(nv.HW_GPU_ONLY), nv.Backend(nv.GPU_ONLY)], 4, ""),
        "GPU": ([nv.Backend(nv.GPU_ONLY)], 4, ""),
        "default_fancy": (None, 4, ":fancy_upsampling=1"),
    }
    decoders, rows = {"torchvision": torchvision}, {}
    for name, (backends, threads, options) in configs.items():
        try:
            decode = make(backends, threads, options)
            out = decode(datas)
            torch.cuda.synchronize()
            pairs = [(o, r) for o, r in zip(out, ref, strict=True) if o is not None]
            rows[name] = {
                "max_diff": [int((o.int() - r.int()).abs().max()) for o, r in pairs],
                "mean_diff": [
                    round(float((o.int() - r.int()).abs().float().mean()), 2) for o, r in pairs
                ],  # fmt: skip
                "progressive": decode([progressive])[0] is not None,
            }
            decoders[name] = decode
        except Exception as err:  # a backend this GPU or build lacks: recorded, the rest go on
            rows[name] = {"error": f"{type(err).__name__}: {err}"}
        print(name, json.dumps(rows[name]), flush=True)
    for name, decode in decoders.items():
        many = [datas[k % 6] for k in range(101)]
        for _ in range(3):
            decode(many)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(10):
            decode(many)
        torch.cuda.synchronize()
        row = rows.setdefault(name, {})
        row["ms_per_101"] = (time.perf_counter() - began) / 10 * 1e3
        row.update(held_while(decode))
        print(name, json.dumps(row), flush=True)
    device = torch.cuda.get_device_name(dev)
    commit = (
        os.environ.get("MGPU_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    record = {"device": device, "torch": torch.__version__, "git_commit": commit, "rows": rows}
    out = ROOT / "bench" / "results"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"jpeg_decoders-{device.replace(' ', '_')}-{stamp}.json").write_text(
        json.dumps(record, indent=1)
    )


if __name__ == "__main__":
    main()

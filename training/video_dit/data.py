"""Training data: a synthetic latent + text source (default) and on-disk latent shards.

On-disk format (written by training/video_dit/make_latents.py): a directory of ``*.pt`` (torch.save) or
``*.safetensors`` files, one sample each, holding
    "latent": float tensor [C, T, H, W]  (VAE latents; T, H and W may differ between samples: with
                                          --micro-batch-size 1, or packed into one sequence by --pack-samples)
    "text":   float tensor [L, D_text]   (text-encoder embeddings)
and, for the Wan entry's image-conditioned tasks (training/wan_diffusers/task.py; written by its prepare step),
passed through when present and required by name where the run needs them:
    "cond_latent":  float tensor [C, T, H, W] (the first frame's VAE latents followed by zero frames' latents)
    "image_embeds": float tensor [N, D_img]   (CLIP image embeddings of the first frame)
Samples are read in sorted file order; sample i of the run is file i mod n.
"""
from __future__ import annotations

import glob
import math
import os
from typing import Sequence

import torch


class SyntheticVideoLatents:
    """Deterministic, visibly learnable samples: coloured stripes moving across the frame.

    Sample i belongs to one of ``NUM_PROMPTS`` "prompts" (``prompt_of(i)``); the prompt fixes the
    stripes' colour (channels 0-2 read as RGB, channel 3 their intensity, further channels zero), their
    orientation and the direction they move in (right, left, down, up; ``SPEED`` latent pixels per
    frame, period ``PERIOD``). The phase varies per sample. The text embedding is the prompt's fixed
    embedding plus a little noise, so a text-conditioned model can learn all three; the tiny demo
    model learns the colour within a minute, the stripes take longer. ``frames`` cycles through the
    given frame counts and ``sizes`` (optional list of (H, W), default [(height, width)]) through latent
    sizes, independently: sample i is frames[i % len(frames)] x sizes[i % len(sizes)]. Values lie in
    ~[-0.1, 1.6] (0.03 noise).
    """

    NUM_PROMPTS = 4
    COLOURS = ((1.5, 0.0, 0.0), (0.0, 1.5, 0.0), (0.2, 0.4, 1.5), (1.5, 1.5, 0.0))  # red, green, blue, yellow
    DIRECTIONS = ((0.0, 1.0), (0.0, -1.0), (1.0, 0.0), (-1.0, 0.0))  # (dy, dx): right, left, down, up
    PERIOD, SPEED = 5.0, 1.0

    def __init__(self, channels: int, frames: Sequence[int], height: int, width: int, text_len: int,
                 text_dim: int, seed: int = 0, sizes: Sequence[tuple] | None = None) -> None:
        self.c, self.frames, self.h, self.w = channels, list(frames), height, width
        self.sizes = [tuple(s) for s in sizes] if sizes else [(height, width)]
        self.period = math.lcm(len(self.frames), len(self.sizes))  # one frame count and size per sample
        self.text_len, self.text_dim, self.seed = text_len, text_dim, seed
        self.prompts = torch.randn(self.NUM_PROMPTS, text_len, text_dim,
                                   generator=torch.Generator().manual_seed(20261123))

    def prompt_of(self, i: int) -> int:
        """The prompt (0..NUM_PROMPTS-1) of sample i; frame counts and prompts vary independently."""
        return (i // self.period) % self.NUM_PROMPTS

    def shape_of(self, i: int) -> tuple:
        """(latent [C, T, H, W] shape, text length) of sample i, without building it."""
        h, w = self.sizes[i % len(self.sizes)]
        return (self.c, self.frames[i % len(self.frames)], h, w), self.text_len

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t, k = self.frames[i % len(self.frames)], self.prompt_of(i)
        height, width = self.sizes[i % len(self.sizes)]
        text = self.prompts[k] + 0.1 * torch.randn(self.text_len, self.text_dim, generator=g)
        dy, dx = self.DIRECTIONS[k]
        phase = float(torch.rand(1, generator=g)) * 2 * math.pi
        tt = torch.arange(t, dtype=torch.float32)[:, None, None]
        yy = torch.arange(height, dtype=torch.float32)[None, :, None]
        xx = torch.arange(width, dtype=torch.float32)[None, None, :]
        coord = yy * abs(dy) + xx * abs(dx) - (dy + dx) * self.SPEED * tt  # [T, H, W]
        wave = 0.5 + 0.5 * torch.cos(2 * math.pi * coord / self.PERIOD + phase)
        colour = torch.zeros(self.c)
        colour[:min(3, self.c)] = torch.tensor(self.COLOURS[k])[:min(3, self.c)]
        if self.c > 3:
            colour[3] = 1.0
        latent = colour[:, None, None, None] * wave[None] + 0.03 * torch.randn(self.c, t, height, width, generator=g)
        return {"latent": latent.float(), "text": text.float()}


# optional tensors a sample may carry (passed through when present): name -> (rank, shape in words)
OPTIONAL = {"cond_latent": (4, "[C, T, H, W]"), "image_embeds": (2, "[N, D_img]")}


class LatentFileError(ValueError):
    """A latent file that cannot be trained on; the message names the file and what is wrong."""


class LatentShardDataset:
    """Samples from a directory of .pt / .safetensors files (see module docstring).

    With ``channels`` / ``text_dim`` / ``patch`` given (the entry points pass the model's), every
    file's header is checked when the dataset is built - names, ranks, channel count, text width,
    divisibility by the patch - so a bad file fails before the first step with its name. Headers
    only: safetensors metadata, or the pickle of a .pt opened with mmap (no tensor bytes read).
    Directories over ``check_up_to`` files check that many up front and the rest when read.
    """

    def __init__(self, path: str, channels: int | None = None, text_dim: int | None = None,
                 patch: tuple | None = None, check_up_to: int = 4096, micro_batch: int = 1,
                 require: dict | None = None) -> None:
        """``require``: {tensor name: why the run needs it} beyond "latent" and "text" (a file without one is
        refused by name with that reason)."""
        self.require = dict(require or {})
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--data-path={path!r} is not a directory")
        self.files = sorted(glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"--data-path={path!r} holds no .pt or .safetensors latent files")
        self.channels, self.text_dim, self.patch = channels, text_dim, patch
        self.shapes: dict = {}  # file -> (latent shape, text length), from the headers
        first = None  # (file, latent shape, text length): micro-batches > 1 need one shape
        for f in self.files[:check_up_to]:
            header = _header(f)
            self._check(f, header)
            shape, length = header["latent"][0], header["text"][0][0]
            self.shapes[f] = (tuple(shape), length)
            if micro_batch > 1 and first is not None and (shape, length) != first[1:]:
                raise LatentFileError(
                    f"{f}: latent {list(shape)}, text L={length}; {first[0]}: latent {list(first[1])}, text "
                    f"L={first[2]}: --micro-batch-size={micro_batch} needs every sample of a micro-batch to have "
                    f"one shape (use --micro-batch-size 1 with variable shapes)")
            first = first or (f, shape, length)

    def __len__(self) -> int:
        return len(self.files)

    def shape_of(self, i: int) -> tuple:
        """(latent [C, T, H, W] shape, text length) of sample i from its file's header (no tensor bytes read)."""
        f = self.files[i % len(self.files)]
        if f not in self.shapes:
            header = _header(f)
            self._check(f, header)
            self.shapes[f] = (tuple(header["latent"][0]), header["text"][0][0])
        return self.shapes[f]

    def __getitem__(self, i: int) -> dict:
        f = self.files[i % len(self.files)]
        try:
            if f.endswith(".safetensors"):
                from safetensors.torch import load_file  # noqa: PLC0415
                d = load_file(f)
            else:
                d = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch / safetensors raise many types
            raise LatentFileError(f"{f}: unreadable latent file ({_first_line(e)})") from None
        if not isinstance(d, dict):
            raise LatentFileError(f"{f}: holds a {type(d).__name__}, expected a dict of tensors 'latent' and 'text'")
        self._check(f, {k: (tuple(v.shape), v.dtype) for k, v in d.items() if isinstance(v, torch.Tensor)})
        return {k: d[k].float() for k in ("latent", "text", *OPTIONAL) if k in d}

    def _check(self, f: str, header: dict) -> None:
        for key, rank, what in (("latent", 4, "[C, T, H, W]"), ("text", 2, "[L, D_text]")):
            if key not in header:
                raise LatentFileError(f"{f}: missing tensor {key!r} (expected 'latent' [C,T,H,W] and 'text' [L,D]; "
                                      f"found {sorted(header)})")
            shape, dtype = header[key]
            if len(shape) != rank or not dtype.is_floating_point:
                raise LatentFileError(f"{f}: {key!r} is {dtype} {list(shape)}, expected a float tensor {what}")
        (c, t, h, w), _ = header["latent"]
        if 0 in (c, t, h, w):
            raise LatentFileError(f"{f}: latent is empty ({[c, t, h, w]} as [C, T, H, W])")
        if self.channels is not None and c != self.channels:
            raise LatentFileError(f"{f}: latent has {c} channels, the model takes {self.channels} (latent [C,T,H,W])")
        if self.patch is not None:
            for n, p, name in ((t, self.patch[0], "frames T"), (h, self.patch[1], "height H"),
                               (w, self.patch[2], "width W")):
                if n % p:
                    raise LatentFileError(f"{f}: latent {name}={n} is not a multiple of the patch size {p}")
        (length, width), _ = header["text"]
        if self.text_dim is not None and width != self.text_dim:
            raise LatentFileError(f"{f}: text embeddings are {width} wide, the model takes {self.text_dim} "
                                  f"(text [L, D_text]; was another text encoder used?)")
        if length < 1:
            raise LatentFileError(f"{f}: text embeddings are empty (L=0)")
        for key, why in self.require.items():
            if key not in header:
                raise LatentFileError(f"{f}: no {key!r} tensor, which {why} (found {sorted(header)})")
        for key, (rank, what) in OPTIONAL.items():
            if key in header:
                shape, dtype = header[key]
                if len(shape) != rank or not dtype.is_floating_point or 0 in shape:
                    raise LatentFileError(f"{f}: {key!r} is {dtype} {list(shape)}, expected a float tensor {what}")
        if "cond_latent" in header and tuple(header["cond_latent"][0]) != tuple(header["latent"][0]):
            raise LatentFileError(f"{f}: 'cond_latent' is {list(header['cond_latent'][0])}, 'latent' "
                                  f"{list(header['latent'][0])}: the condition has the latent's shape [C, T, H, W]")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _header(f: str) -> dict:
    """{name: (shape, dtype)} of a latent file without reading its tensor bytes."""
    try:
        if f.endswith(".safetensors"):
            from safetensors import safe_open  # noqa: PLC0415
            out = {}
            with safe_open(f, framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    out[k] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), torch.uint8))
            return out
        try:
            d = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # torch.save's legacy (non-zip) format cannot be memory-mapped: read it whole
            if "_use_new_zipfile_serialization" not in str(e):
                raise
            d = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise LatentFileError(f"{f}: unreadable latent file (corrupt, truncated or not a tensor file: "
                              f"{_first_line(e)})") from None
    if not isinstance(d, dict):
        raise LatentFileError(f"{f}: holds a {type(d).__name__}, expected a dict of tensors 'latent' and 'text'")
    return {k: (tuple(v.shape), v.dtype) for k, v in d.items() if isinstance(v, torch.Tensor)}


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def write_sample(path: str, latent: torch.Tensor, text: torch.Tensor, fmt: str = "pt",
                 extra: dict | None = None) -> None:
    """Write one sample in the on-disk format (``extra``: optional tensors, e.g. "cond_latent", "image_embeds")."""
    tensors = {"latent": latent.contiguous(), "text": text.contiguous(),
               **{k: v.contiguous() for k, v in (extra or {}).items()}}
    if fmt == "safetensors":
        from safetensors.torch import save_file  # noqa: PLC0415
        save_file(tensors, path)
    else:
        torch.save(tensors, path)

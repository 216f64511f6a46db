"""Videos and captions in, bucketed clips out (CPU only: no model here).

    items = discover(root, captions=None)          # [VideoItem], sorted by source
    buckets = Buckets(frames=(81, 49), sizes=((480, 832), (832, 480)))
    clip = read_clip(item, buckets, stride=1)      # Clip.frames_fhwc: uint8 [F, H, W, 3]

Inputs: video files (.mp4 .webm .mov .mkv .avi, read with imageio's ffmpeg plugin as diffusers' load_video does) or
folders of image frames (.png .jpg .jpeg .webp .bmp, in natural name order). Captions: ``<name>.txt`` beside each
video / frame folder, or a captions file (.jsonl lines {"path": ..., "caption": ...}; .csv with a header naming the
columns path and caption; "video"/"file" and "text"/"prompt" are accepted as the column names too), paths relative
to the input folder.

Buckets: each clip takes the (H, W) bucket nearest to its aspect ratio (|log(aspect / bucket aspect)| smallest, the
first listed on a tie), is resized to cover it (Lanczos, as diffusers' image processor) and center-cropped; its frame
count is the largest bucket count it has (every ``stride``-th frame from the first). Bad input raises
``VideoInputError`` naming the file and what is wrong.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_sp_ext.errors import UserError

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PATH_KEYS = ("path", "video", "file")
CAPTION_KEYS = ("caption", "text", "prompt")


class VideoInputError(UserError):
    """A video, frame folder or caption that cannot be prepared; the message names the file."""


@dataclass(frozen=True)
class VideoItem:
    """One input. source: its path relative to the input root (the sample's name); path: absolute; kind: "video"
    or "frames" (a folder of images)."""

    source: str
    path: str
    caption: str
    kind: str


@dataclass(frozen=True)
class Buckets:
    """Frame counts (each 1 + a multiple of the VAE's temporal factor) and (H, W) pixel sizes."""

    frames: tuple
    sizes: tuple

    def size_for(self, height: int, width: int) -> tuple:
        """The (H, W) bucket nearest in aspect ratio to a ``height`` x ``width`` frame."""
        aspect = width / height
        return min(self.sizes, key=lambda hw: abs(math.log(aspect * hw[0] / hw[1])))

    def frames_for(self, available: int) -> Optional[int]:
        """The largest frame count <= ``available`` (None: fewer than the smallest)."""
        fit = [f for f in self.frames if f <= available]
        return max(fit) if fit else None


@dataclass
class Clip:
    """A bucketed clip: frames_fhwc uint8 [F, H, W, 3]; available: frames the input had (after the stride, up to
    the largest bucket)."""

    frames_fhwc: np.ndarray
    available: int


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", name)]


def _is_frame_folder(path: str) -> bool:
    return os.path.isdir(path) and any(f.lower().endswith(IMAGE_EXTS) for f in os.listdir(path))


def _kind(path: str) -> Optional[str]:
    if os.path.isfile(path) and path.lower().endswith(VIDEO_EXTS):
        return "video"
    if _is_frame_folder(path):
        return "frames"
    return None


def _read_caption_txt(path: str) -> str:
    txt = os.path.splitext(path.rstrip(os.sep))[0] + ".txt" if os.path.isfile(path) else path.rstrip(os.sep) + ".txt"
    if not os.path.isfile(txt):
        raise VideoInputError(f"{path}: no caption: expected {txt} beside it (or give --captions FILE, a .jsonl / "
                              f".csv of path,caption)")
    with open(txt, encoding="utf-8") as f:
        return f.read().strip()


def discover(root: str, captions: Optional[str] = None) -> list:
    """Every input under ``root`` (recursively; a folder holding images is one frame sequence) with its caption
    (``<name>.txt`` beside it), or exactly the entries of ``captions`` (.jsonl / .csv). Sorted by source.
    Raises VideoInputError naming the first input without a caption or the captions file's bad line."""
    if not os.path.isdir(root):
        raise VideoInputError(f"--input {root}: no such folder")
    if captions is not None:
        return sorted(_listed(root, captions), key=lambda it: it.source)
    items = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if _is_frame_folder(full):
                dirnames.remove(d)   # a frame sequence: not searched further
                items.append(VideoItem(os.path.relpath(full, root), full, _read_caption_txt(full), "frames"))
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            if f.lower().endswith(VIDEO_EXTS):
                items.append(VideoItem(os.path.relpath(full, root), full, _read_caption_txt(full), "video"))
    if not items:
        raise VideoInputError(f"--input {root}: no videos ({', '.join(VIDEO_EXTS)}) or folders of image frames "
                              f"({', '.join(IMAGE_EXTS)}) found")
    return sorted(items, key=lambda it: it.source)


def _pick(row: dict, keys: tuple, where: str, what: str) -> str:
    for k in keys:
        if k in row and row[k] is not None:
            return str(row[k])
    raise VideoInputError(f"{where}: no {what} (a key named {' / '.join(keys)}); found {sorted(row)}")


def _listed(root: str, captions: str) -> list:
    if not os.path.isfile(captions):
        raise VideoInputError(f"--captions {captions}: no such file")
    rows = []
    with open(captions, encoding="utf-8", newline="") as f:
        if captions.lower().endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise VideoInputError(f"--captions {captions} line {n}: not JSON ({e})") from None
                    if not isinstance(row, dict):
                        raise VideoInputError(f"--captions {captions} line {n}: expected an object "
                                              f"{{\"path\": ..., \"caption\": ...}}")
                    rows.append((f"--captions {captions} line {n}", row))
        elif captions.lower().endswith(".csv"):
            for n, row in enumerate(csv.DictReader(f), 2):
                rows.append((f"--captions {captions} line {n}", row))
        else:
            raise VideoInputError(f"--captions {captions}: expected a .jsonl or .csv file of path,caption")
    items, seen = [], set()
    for where, row in rows:
        rel = _pick(row, PATH_KEYS, where, "video path")
        full = rel if os.path.isabs(rel) else os.path.join(root, rel)
        kind = _kind(full)
        if kind is None:
            raise VideoInputError(f"{where}: {full} is neither a video file ({', '.join(VIDEO_EXTS)}) nor a folder "
                                  f"of image frames")
        source = os.path.relpath(full, root)
        if source in seen:
            raise VideoInputError(f"{where}: {source} is listed twice (one caption per video)")
        seen.add(source)
        items.append(VideoItem(source, full, _pick(row, CAPTION_KEYS, where, "caption").strip(), kind))
    if not items:
        raise VideoInputError(f"--captions {captions}: lists no videos")
    return items


def _frames(item: VideoItem):
    """Iterate the item's frames as uint8 [H, W, 3] arrays."""
    if item.kind == "frames":
        from PIL import Image  # noqa: PLC0415
        names = sorted((f for f in os.listdir(item.path) if f.lower().endswith(IMAGE_EXTS)), key=_natural_key)
        for name in names:
            try:
                with Image.open(os.path.join(item.path, name)) as im:
                    yield np.asarray(im.convert("RGB"))
            except OSError as e:
                raise VideoInputError(f"{os.path.join(item.path, name)}: unreadable image ({e})") from None
        return
    try:
        import imageio.v2 as imageio  # noqa: PLC0415
    except ImportError as e:   # pragma: no cover - a dependency of the [diffusers] extra
        raise VideoInputError(f"reading {item.path} needs imageio and imageio-ffmpeg (pip install "
                              f"'megatron_sp_ext[diffusers]'): {e}") from None
    try:
        reader = imageio.get_reader(item.path, "ffmpeg")
    except Exception as e:  # noqa: BLE001 - imageio / ffmpeg raise many types for a bad file
        raise VideoInputError(f"{item.path}: unreadable video ({_first_line(e)})") from None
    try:
        it = iter(reader)
        while True:
            try:
                frame = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001
                raise VideoInputError(f"{item.path}: unreadable video ({_first_line(e)})") from None
            yield np.asarray(frame)[..., :3]
    finally:
        reader.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def resize_crop(frame_hwc: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize ``frame_hwc`` (uint8 [h, w, 3]) to cover ``height`` x ``width`` (Lanczos) and center-crop it there."""
    from PIL import Image  # noqa: PLC0415
    h, w = frame_hwc.shape[:2]
    if (h, w) == (height, width):
        return frame_hwc
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    img = Image.fromarray(frame_hwc)
    if (nh, nw) != (h, w):
        img = img.resize((nw, nh), resample=Image.LANCZOS)
    top, left = (nh - height) // 2, (nw - width) // 2
    return np.asarray(img.crop((left, top, left + width, top + height)))


def read_clip(item: VideoItem, buckets: Buckets, stride: int = 1) -> Clip:
    """The item's clip: every ``stride``-th frame from the first, as many as the largest frame bucket that fits,
    resized and center-cropped to its (H, W) bucket. Raises VideoInputError naming the file when it is unreadable
    or has fewer frames than the smallest bucket."""
    want = max(buckets.frames)
    kept, size = [], None
    for i, frame in enumerate(_frames(item)):
        if i % stride:
            continue
        if frame.ndim != 3 or frame.shape[2] < 3 or 0 in frame.shape[:2]:
            raise VideoInputError(f"{item.path}: frame {i} is {list(frame.shape)}, expected an RGB image [H, W, 3]")
        if size is None:
            size = buckets.size_for(*frame.shape[:2])
        kept.append(resize_crop(np.ascontiguousarray(frame[..., :3]), *size))
        if len(kept) == want:
            break
    n = buckets.frames_for(len(kept))
    if n is None:
        read = f"{len(kept)} frame(s)" + (f" (every {stride}th, --frame-stride {stride})" if stride > 1 else "")
        raise VideoInputError(f"{item.path}: {read}, fewer than the smallest --frames bucket {min(buckets.frames)}: "
                              f"drop it, give a smaller --frames bucket, or pass --skip-bad-inputs")
    return Clip(np.stack(kept[:n]), len(kept))


def parse_sizes(text: str, flag: str = "--buckets") -> tuple:
    """'480x832,832x480' -> ((480, 832), (832, 480)) (height x width, pixels)."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not m or 0 in (int(m.group(1)), int(m.group(2))):
            raise VideoInputError(f"{flag} {text!r}: expected HxW pixel sizes, comma separated (e.g. 480x832,832x480)")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def parse_counts(text: str, flag: str) -> tuple:
    """'81,49' -> (81, 49)."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise VideoInputError(f"{flag} {text!r}: expected comma-separated integers (e.g. 81,49)") from None
    if not out or min(out) < 1:
        raise VideoInputError(f"{flag} {text!r}: expected positive integers")
    return out


def check_buckets(buckets: Buckets, temporal: int, spatial_multiple: int) -> None:
    """Frame counts 1 + k * ``temporal`` (the VAE's causal frames), sizes multiples of ``spatial_multiple`` (the VAE's
    spatial factor x the transformer's 2 x 2 patch); VideoInputError naming --frames / --buckets otherwise."""
    bad = [f for f in buckets.frames if (f - 1) % temporal]
    if bad:
        raise VideoInputError(f"--frames {','.join(map(str, buckets.frames))}: {bad} not of the form "
                              f"{temporal}n+1 (Wan's VAE encodes the first frame, then {temporal} at a time), e.g. 81, "
                              f"49, 33, 17")
    bad = [f"{h}x{w}" for h, w in buckets.sizes if h % spatial_multiple or w % spatial_multiple]
    if bad:
        raise VideoInputError(f"--buckets: {', '.join(bad)} not multiples of {spatial_multiple} (this VAE's spatial "
                              f"factor x the transformer's 2x2 patch)")

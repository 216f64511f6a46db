"""Print the versions of the stack this interpreter sees (one line; used by `make test`)."""
from importlib import metadata


def main() -> None:
    parts = []
    for dist in ("torch", "megatron-core", "deepspeed"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    print(", ".join(parts))


if __name__ == "__main__":
    main()

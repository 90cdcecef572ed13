"""Where LoRA adapters may be loaded from at run time: `--lora-allowed-dirs`, shared by the
engine (which reads the files) and the router (which checks before it asks any engine).

Role: `AdapterRoots` holds the operator's directories, resolved once at start-up, and checks a
requested `lora_path` against them: `check_inside` on the path alone (the router: adapters
live on the engines' file system, which it may not see) and `check_loadable` on the file
system too (the engine).

Invariants:
- A path is inside a root only after `os.path.realpath` (symlinks and `..` resolved), so
  neither `/adapters/../etc` nor a symlink out of a root passes.
- Every refusal is one identical message (`REFUSED_MESSAGE`, a 400 naming `lora_path`): a path
  outside the roots, one that does not exist and one that cannot be read look the same, so the
  endpoint is no oracle for the file system.
- No roots configured: `configured` is False and the checks pass every path (the engine's
  behaviour before the flag, for adapters named by the operator only).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvfleet.contracts.errors import InvalidFieldError

# The files PEFT's save_pretrained writes, which loading reads (engine/lora/peft_adapter.py).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
REFUSED_MESSAGE = (
    "lora_path is not a readable LoRA adapter directory inside the directories this server "
    "loads adapters from (--lora-allowed-dirs)"
)


@dataclass(frozen=True)
class AdapterRoots:
    """The directories runtime adapter loads must resolve into (real paths)."""

    dirs: tuple[str, ...] = ()

    @classmethod
    def of(cls, dirs: Iterable[str | Path], must_exist: bool = True) -> AdapterRoots:
        """Roots from the flag's values; ValueError for a relative one, or one that is not a
        directory here when `must_exist` (the engine; a router may not mount them)."""
        resolved = []
        for entry in dirs:
            if not os.path.isabs(entry):
                raise ValueError(f"--lora-allowed-dirs: {entry} is not an absolute path")
            real = os.path.realpath(entry)
            if must_exist and not os.path.isdir(real):
                raise ValueError(f"--lora-allowed-dirs: {entry} is not a directory")
            resolved.append(real)
        return cls(tuple(resolved))

    @property
    def configured(self) -> bool:
        return bool(self.dirs)

    def check_inside(self, path: str) -> str:
        """`path` resolved, if it lies inside a root; else the one refusal (InvalidFieldError)."""
        if not self.configured:
            return path
        real = os.path.realpath(path) if os.path.isabs(path) else ""
        if not real or not any(_within(real, root) for root in self.dirs):
            raise adapter_path_refused()
        return real

    def check_loadable(self, path: str) -> str:
        """`check_inside`, and the adapter's files exist and are readable here."""
        real = self.check_inside(path)
        if self.configured and not all(
            os.access(os.path.join(real, name), os.R_OK) for name in ADAPTER_FILES
        ):
            raise adapter_path_refused()
        return real


def adapter_path_refused() -> InvalidFieldError:
    return InvalidFieldError("lora_path", REFUSED_MESSAGE)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def add_allowed_dirs_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--lora-allowed-dirs", nargs="+", default=[], metavar="DIR",
        help="directories LoRA adapters may be loaded from at run time (real paths; symlinks "
             "out of them are refused); none: any path",
    )

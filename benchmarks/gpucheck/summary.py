"""summary.md: the GPU section of docs/BENCHMARKS.md, filled with a run's numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"


def _range(lo_hi: Sequence[int] | None) -> str:
    if not lo_hi:
        return ""
    lo, hi = lo_hi
    return f"{lo}" if lo == hi else f"{lo} .. {hi}"


def part_line(name: str, found: dict[str, Any]) -> str:
    """One cell: what the part found, in a few words."""
    if name == "environment":
        return f"{found.get('gpu', found.get('device', ''))}, workspaces {_mib(found.get('workspace_bytes'))}"
    if name in ("pytest", "suite"):
        c = found.get("counts")
        text = ", ".join(f"{v} {k}" for k, v in c.items()) if c else found.get("cut_short", "")
        return f"torch {found['torch']}: {text}" if name == "suite" and "torch" in found else text
    if name == "planner":
        cells = []
        for row in found.get("configs", []):
            s = row.get("stats", {})
            cells.append(
                f"{row['model']} {row['precision']}: {s.get('tracker_exact', 0)}/"
                f"{s.get('measured', 0)} exact"
            )
        return "; ".join(cells)
    if name == "shapes":
        return "; ".join(
            f"{r['precision']}: tracker - predicted {r['tracker'] - r['predicted']}, "
            f"allocator - predicted {r['allocated'] - r['predicted']}"
            for r in found.get("rows", [])
        )
    if name == "bench":  # one line per memory level, joined for the table's cell
        lines = found.get("recommendation", "").splitlines()
        return "; ".join(line.strip() for line in lines[1:]) or "".join(lines)
    if name == "offload":
        cases = found.get("cases", {})
        return "; ".join(
            f"{c} {r['time_ratio']:.2f}x" for c, r in cases.items() if "time_ratio" in r
        )
    if name == "overhead":
        r = found.get("ratios", {}).get("sin", {})
        return "remat/torch on sin: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) if r else ""
    return ""


def render(summary: dict[str, Any]) -> str:
    """summary.md: docs/BENCHMARKS.md's GPU section, filled with this run's numbers."""
    parts = summary["parts"]
    env = parts.get("environment", {}).get("results", {})
    what = "dry run on CPU (numbers mean nothing)" if summary["dry_run"] else env.get("gpu", "?")
    torch_version = env.get("torch") or parts.get("suite", {}).get("results", {}).get("torch")
    lines = [
        f"### GPU check: {what}, torch {torch_version or '?'} ({summary['started']})",
        "",
        f"`{summary['command']}`, {summary.get('seconds', '?')} s. {environment_line(env)}",
        "",
        "| part | status | seconds | limit s | result |",
        "|---|---|---|---|---|",
    ]
    for name, entry in parts.items():
        result = part_line(name, entry["results"])
        if entry.get("error"):
            result = f"{entry['error'][:200]}; {result}"
        lines.append(
            f"| {name} | {entry['status']} | {entry['seconds']} | {entry['limit_s']:.0f} | "
            f"{result.replace('|', '/')} |"
        )
    for name, fn in (
        ("pytest", _render_pytest),
        ("planner", _render_planner),
        ("shapes", _render_shapes),
        ("bench", _render_bench),
        ("offload", _render_offload),
        ("overhead", _render_overhead),
        ("suite", _render_suite),
    ):
        if name in parts:
            lines += ["", *fn(parts[name]["results"])]
    return "\n".join(lines) + "\n"


def environment_line(env: dict[str, Any]) -> str:
    """Versions and the device in one sentence, leaving out what was not recorded."""
    items = [
        ("torch", env.get("torch")),
        ("CUDA", env.get("cuda")),
        ("cuDNN", env.get("cudnn")),
        ("driver", env.get("driver")),
        ("capability", env.get("capability")),
        ("memory", env.get("gpu_memory_bytes") and _mib(env["gpu_memory_bytes"])),
        (
            "cuBLAS/cuDNN workspaces",
            env.get("workspace_bytes") is not None and _mib(env["workspace_bytes"]),
        ),
        ("remat", env.get("remat")),
        (
            "commit",
            env.get("commit") and env["commit"] + (" (modified)" if env.get("dirty") else ""),
        ),
    ]
    return ", ".join(f"{k} {v}" for k, v in items if v) + "."


def _render_pytest(found: dict[str, Any]) -> list[str]:
    lines = ["#### `pytest -m gpu`", ""]
    bad = [t for t in found.get("tests", []) if t["outcome"] != "passed"]
    if "counts" in found:
        lines.append(", ".join(f"{v} {k}" for k, v in found["counts"].items()) + ".")
    for t in bad:
        lines.append(f"- {t['outcome']}: `{t['test']}`: {t['message']}")
    return lines


def _render_suite(found: dict[str, Any]) -> list[str]:
    lines = [
        f"#### The default test suite (`python -m pytest -q`), torch {found.get('torch', '?')}",
        "",
    ]
    if "counts" in found:
        lines.append(
            ", ".join(f"{v} {k}" for k, v in found["counts"].items())
            + f" ({found.get('shards', '?')} shards side by side"
            + (f"; {found['cut_short']}" if found.get("cut_short") else "")
            + ")."
        )
    for t in found.get("not_passed", []):
        lines.append(f"- {t['outcome']}: `{t['test']}`: {t['message']}")
    return lines


def _render_planner(found: dict[str, Any]) -> list[str]:
    lines = [
        "#### Planner exactness (per-block plans, AdamW; bytes: measured - predicted)",
        "",
        "| model | precision | plans | tracker exact | tracker | allocator | allocator within scratch | scratch | reserved - allocated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    off = []
    for row in found.get("configs", []):
        s = row.get("stats", {})
        lines.append(
            f"| {row['model']} | {row['precision']} | {s.get('measured', 0)}/"
            f"{row.get('per_block_plans', '?')} | {s.get('tracker_exact', '')} | "
            f"{_range(s.get('tracker_minus_predicted'))} | "
            f"{_range(s.get('allocated_minus_predicted'))} | "
            f"{s.get('allocated_within_scratch', '')} | {row.get('scratch_bytes', '')} | "
            f"{_range(s.get('reserved_minus_allocated'))} |"
        )
        off += [(row, p) for p in row["plans"] if p["tracker"] != p["predicted"]]
    if off:
        lines += ["", "Plans the tracker did not measure as predicted (first 10):", ""]
        lines += ["| model | precision | decisions | predicted | tracker | allocator |"]
        lines += ["|---|---|---|---|---|---|"]
        for row, p in off[:10]:
            lines.append(
                f"| {row['model']} | {row['precision']} | {','.join(p['decisions'])} | "
                f"{p['predicted']} | {p['tracker']} | {p['allocated']} |"
            )
    return lines


def _render_shapes(found: dict[str, Any]) -> list[str]:
    """The part's table: bytes predicted from shapes against what the device measured."""
    lines = [
        "#### Plans from shapes (a meta copy planned for the device; bytes)",
        "",
        f"Calibration saved: `{found.get('calibration', '?')}`.",
        "",
        "| model dtype | decisions | predicted from shapes | on the device's profile | "
        "tracker - predicted | allocator - predicted | device profile's scratch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in found.get("rows", []):
        lines.append(
            f"| {r['precision']} | {','.join(r['decisions'])} | {r['predicted']} | "
            f"{r['on_device_predicted']} | {r['tracker'] - r['predicted']} | "
            f"{r['allocated'] - r['predicted']} | {r['on_device_scratch']} |"
        )
    return lines


def _render_bench(found: dict[str, Any]) -> list[str]:
    m = found.get("model", {})
    lines = [
        f"#### `remat bench` ({m.get('layers')} layers, d={m.get('d_model')}, seq {m.get('seq')}, "
        f"batch {m.get('batch')})",
        "",
    ]
    if "table" in found:
        lines += ["```text", found["table"], "```", "", found["how"], ""]
        lines += ["```text", found["recommendation"], "```", ""]  # one line per memory level
        if found.get("plans_vs_uniform"):  # each auto row against the uniform rows' hull
            lines += ["```text", found["plans_vs_uniform"], "```", ""]
        lines.append(found["noise"])
    elif "last_done" in found:
        lines.append(f"Stopped after {found['last_done']}.")
    return lines


def _render_offload(found: dict[str, Any]) -> list[str]:
    bw = found.get("bandwidth", {})
    lines = [
        "#### Offload: remat.offload against save_on_cpu and recompute",
        "",
        f"Pinned copies: device to host {bw.get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s, "
        f"host to device {bw.get('h2d_bytes_per_s', 0) / 1e9:.1f} GB/s.",
        "",
        "| strategy | device peak | allocator peak | host bytes | step | time x | copies | hidden | max abs dgrad |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in found.get("cases", {}).items():
        step = f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else ""
        ratio = f"{r['time_ratio']:.2f}" if "time_ratio" in r else ""
        copy = f"{r['copy_s'] * 1e3:.1f} ms" if "copy_s" in r else ""
        hidden = f"{r['hidden_share']:.2f}" if "hidden_share" in r else ""
        lines.append(
            f"| {case} | {_mib(r['device_peak'])} | {_mib(r['allocated_peak'])} | "
            f"{_mib(r['offloaded_bytes'])} | {step} | {ratio} | {copy} | {hidden} | "
            f"{r['max_grad_diff']:.2g} |"
        )
    return lines


def _render_overhead(found: dict[str, Any]) -> list[str]:
    lines = [
        "#### Per-call overhead (remat's over torch's, above the plain call)",
        "",
        "| op | plain call | non-reentrant | reentrant | selective |",
        "|---|---|---|---|---|",
    ]
    for op, ratios in found.get("ratios", {}).items():
        plain = found["seconds_per_call"][op]["plain"]
        cells = " | ".join(f"{ratios[v]:.2f}" for v in ("non-reentrant", "reentrant", "selective"))
        lines.append(f"| {op} | {plain * 1e6:.1f} us | {cells} |")
    if "wrapper_ratio" in found:
        lines += ["", f"Module wrapper: {found['wrapper_ratio']:.2f}."]
    return lines

"""Read Prometheus text from a server's /metrics: enough parsing for tests and the benchmark."""

from __future__ import annotations

import re
import urllib.request

Sample = tuple[str, tuple[tuple[str, str], ...]]
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str, only: tuple[str, ...] = ()) -> dict[Sample, float]:
    """Every sample in `text`; with `only`, just those whose name starts with one of them
    (other lines are skipped unparsed: a vLLM server's /metrics is ~80 KB)."""
    samples: dict[Sample, float] = {}
    for line in text.splitlines():
        if only and not line.startswith(only):
            continue
        match = _LINE.match(line)
        if not match or line.startswith("#"):
            continue
        name, _, labels, value = match.groups()
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        try:
            samples[(name, pairs)] = float(value)
        except ValueError:
            continue
    return samples


def scrape(url: str, timeout: float = 5.0, only: tuple[str, ...] = ()) -> dict[Sample, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode(), only)


PROMPT_SOURCES = "vllm:prompt_tokens_by_source_total"  # a server's prompt tokens by source


def transferred(samples: dict[Sample, float]) -> float:
    """Prompt tokens a server counted as loaded by KV transfer (a decode's external KV)."""
    return total(samples, PROMPT_SOURCES, source="external_kv_transfer")


def total(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """Sum of every sample called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and wanted <= set(pairs))

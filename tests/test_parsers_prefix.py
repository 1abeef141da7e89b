"""Logger prefixes of every version, trimmed variants, and foreign lines (§8-§9 of the reference)."""

from __future__ import annotations

import time

import pytest

from parsers.prefix import PrefixSplitter

TS = time.mktime((2024, 6, 18, 2, 41, 9, 0, 0, -1)) + 0.377
MSG = "{ Epoch:[  1/  1], step:[  210/ 4000], loss: 4.086"

PREFIXED = [
    ("r0.2-stdout", f"2024-06-18 02:41:09,377 - mindformers - INFO - {MSG}", "INFO"),
    ("r0.2-file-abs-path",
     f"[INFO] 2024-06-18 02:41:09,377 [/home/ma-user/code/mindformers/mindformers/core/callback/callback.py:262] "
     f"print_output_info: {MSG}", "INFO"),
    ("r0.7-stdout-filename", f"2024-06-18 02:41:09,377 - mindformers[callback.py:310] - INFO - {MSG}", "INFO"),
    ("v1.0-stdout-filepath",
     f"2024-06-18 02:41:09,377 - mindformers[mindformers/core/callback/callback.py:318] - INFO - {MSG}", "INFO"),
    ("v1.0-file", f"[INFO] 2024-06-18 02:41:09,377 [mindformers/core/callback/callback.py:318] print_output_info: {MSG}",
     "INFO"),
    ("v1.5-name-with-path",
     f"2024-06-18 02:41:09,377 - mindformers/data/jobs/qwen-sft/output/log[mindformers/core/callback/callback.py:612]"
     f" - INFO - {MSG}", "INFO"),
    ("raw-path-outside-package", f"2024-06-18 02:41:09,377 - mindformers[../reward_eval.py:57] - WARNING - {MSG}",
     "WARNING"),
    ("stdin", f"[ERROR] 2024-06-18 02:41:09,377 [<stdin>:3] <module>: {MSG}", "ERROR"),
    ("docs-trimmed-name", f"2024-06-18 02:41:09,377 - [mindformers/core/callback/callback.py:318] - INFO - {MSG}",
     "INFO"),
]


@pytest.mark.parametrize("line,level", [c[1:] for c in PREFIXED], ids=[c[0] for c in PREFIXED])
def test_prefixes_of_every_version(line: str, level: str) -> None:
    m = PrefixSplitter().split(line)
    assert (m.text, m.level, m.foreign) == (MSG, level, False)
    assert m.timestamp == pytest.approx(TS)


def test_docs_trimmed_line_without_timestamp() -> None:
    m = PrefixSplitter().split(f"- INFO - {MSG}")
    assert (m.text, m.timestamp, m.level) == (MSG, None, "INFO")


def test_bare_line_is_kept_whole() -> None:
    m = PrefixSplitter().split(MSG)
    assert (m.text, m.timestamp, m.foreign) == (MSG, None, False)


FOREIGN = [
    ("ms-python", "[WARNING] ME(41872:140215583209280,MainProcess):2025-09-03-11:20:45.118.602 "
     "[mindspore/train/serialization.py:1530] 2 parameters in the 'net' are not loaded.", "WARNING"),
    ("ms-cpp", "[ERROR] DEVICE(41872,7f3a2c1ff640,python):2025-09-03-11:21:02.734.019 "
     "[mindspore/ccsrc/runtime/device/kernel_runtime.cc:880] SyncStream] Sync stream failed, device_id: 3", "ERROR"),
    ("cann", "EZ9999[PID: 41872] 2025-09-03-11:21:01.502.337 (EZ9999):  The error from device(chipId:3, dieId:0)",
     "ERROR"),
    ("mindio", "2025-09-03 11:20:40.551207 info 41872 [TTP controller.cpp:1620] rank:3, heartbeat ok", None),
]


@pytest.mark.parametrize("line,level", [c[1:] for c in FOREIGN], ids=[c[0] for c in FOREIGN])
def test_foreign_lines_are_recognised(line: str, level: str | None) -> None:
    m = PrefixSplitter().split(line)
    assert m.foreign and m.level == level and m.text == line


def test_timestamp_cache_does_not_leak_between_seconds() -> None:
    sp = PrefixSplitter()
    a = sp.split("2024-06-18 02:41:09,377 - mindformers - INFO - x").timestamp
    b = sp.split("2024-06-18 02:41:10,001 - mindformers - INFO - x").timestamp
    assert b is not None and a is not None and b - a == pytest.approx(0.624)

"""Benchmarking: timers, FLOP/byte rooflines, suites per op family, reports
and regression tracking against baselines (`stellax bench`)."""

from .measurement import MODES, BenchmarkRecord, benchmark
from .roofline import Peaks, analyze, datasheet_peaks, device_peaks
from .timing import Stats, make_timer, summarize

__all__ = ["BenchmarkRecord", "MODES", "Peaks", "Stats", "analyze", "benchmark", "datasheet_peaks",
           "device_peaks", "make_timer", "summarize"]

"""Run-time paging of expert weights: page table, plane arena, budget, pager, pressure signal, controller.

See docs/runtime.md for the mechanism and its ordering guarantees.
"""

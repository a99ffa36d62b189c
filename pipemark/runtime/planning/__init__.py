"""The layout planner for a cluster you do not have: the cluster as numbers
(``cluster``), what a model costs on a layout (``workload``), the programs the
runtime would dispatch for a schedule (``dispatches``), and the step time and memory
predicted for each layout with the schedules' simulation (``planner``). Nothing here
traces, compiles or runs a program.
"""

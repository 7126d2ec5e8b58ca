"""``shardkit bench``: throughput, time-to-find and shrink quality, measured side by side.

Ratios are taken within one process and one run, so a noisy shared machine
shifts both sides alike. Nothing here asserts a speed: it prints figures.

``settings`` holds what a bench run measures with (``BenchSettings``, ``QUICK``) and its
sections; ``timing`` runs the sides of a comparison interleaved and picks the median round;
``bare`` is a copy of a kit machine that only counts (what Hypothesis alone costs). One
module per group of sections measures them: ``throughput`` (with the profile and the
engines), ``out_of_process``, ``planted``, ``concurrency``, ``memory``, ``scale_out`` (with
``campaign_scaling``) and ``native_threads``. ``run`` measures the sections asked for and
``render`` draws their figures as the tables the command prints.

Private: only the command line (``shardkit._cli``) imports this package, and it imports
nothing of the command line (``tests/test_import_graph.py``). Nothing is imported here, so
that naming a module of it (the command's parser reads ``settings``) loads no section.
"""

"""The report page's style sheet, inlined into the page: it fetches nothing (no font, no
image, no script), so it reads the same offline, in any browser, and printed."""

from __future__ import annotations

__all__ = ["STYLE"]

STYLE = """
:root {
  --ink: #1d2330; --muted: #5d6677; --rule: #d5dae3; --paper: #ffffff; --wash: #f4f6fa;
  --ok: #1f7a44; --ok-wash: #e3f4ea; --warn: #8a5a00; --warn-wash: #fff1d6;
  --bad: #b3261e; --bad-wash: #fde7e5; --fault: #7a3fb0; --fault-wash: #f1e8fb;
  --lane: #c3cad6; --accent: #2c5fb3;
}
* { box-sizing: border-box; }
html { background: var(--paper); color: var(--ink); }
body { margin: 0 auto; padding: 20px 28px 40px; max-width: 1280px;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
code, pre, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, "DejaVu Sans Mono", monospace;
  font-size: 12.5px; }
pre { white-space: pre-wrap; word-break: break-word; background: var(--wash); padding: 10px 12px;
  border-radius: 6px; margin: 6px 0; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 10px; padding-bottom: 4px; border-bottom: 2px solid var(--rule); }
h3 { font-size: 15px; margin: 16px 0 6px; }
a { color: var(--accent); }
.summary { display: flex; flex-wrap: wrap; align-items: baseline; gap: 6px 18px;
  padding-bottom: 12px; border-bottom: 1px solid var(--rule); }
.summary .target { font-weight: 600; }
.verdict { font-weight: 600; padding: 2px 10px; border-radius: 12px; margin: 0; }
.verdict.failed { background: var(--bad-wash); color: var(--bad); }
.verdict.passed { background: var(--ok-wash); color: var(--ok); }
.counts, .muted { color: var(--muted); margin: 0; }
nav.contents { width: 100%; color: var(--muted); }
nav.contents a { margin-right: 12px; }
.violation { border: 2px solid var(--bad); background: var(--bad-wash); border-radius: 8px;
  padding: 10px 14px; margin: 8px 0 14px; }
.violation p { margin: 0 0 6px; }
.violation .rule { background: #fff; padding: 1px 5px; border-radius: 4px; }
dl.expected-observed { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0; }
dl.expected-observed dt { font-weight: 600; color: var(--muted); }
dl.expected-observed dd { margin: 0; }
table { border-collapse: collapse; }
table.swimlanes { width: 100%; table-layout: fixed; margin: 6px 0; }
table.swimlanes th, table.swimlanes td { vertical-align: top; }
table.swimlanes thead th { text-align: center; padding: 6px 4px; background: var(--wash);
  border-bottom: 2px solid var(--lane); font-weight: 600; overflow-wrap: anywhere; }
table.swimlanes .step-col { width: 56px; text-align: right; padding: 8px 10px 8px 0; color: var(--muted);
  font-variant-numeric: tabular-nums; }
td.lane-cell { padding: 4px 6px; }
td.lane-cell.idle, td.phase-cell.idle { background: linear-gradient(to right, transparent calc(50% - 1px),
  var(--lane) calc(50% - 1px), var(--lane) calc(50% + 1px), transparent calc(50% + 1px)); }
td.span-cell { padding: 4px 6px; }
tr.step > * { border-top: 1px solid #eef0f4; }
tr.violating > th.step-col { color: var(--bad); font-weight: 700; }
.call { border: 1px solid var(--rule); border-left: 4px solid var(--ok); border-radius: 6px; background: #fff;
  padding: 6px 8px; box-shadow: 0 1px 1px rgba(0,0,0,.04); }
.call.refused { border-left-color: var(--warn); }
.call.violating { border: 2px solid var(--bad); border-left-width: 6px; background: var(--bad-wash); }
.call-head { display: flex; flex-wrap: wrap; gap: 2px 8px; align-items: baseline; }
.op { font-weight: 700; }
.args { color: var(--muted); }
.note { color: var(--warn); font-style: italic; }
.answers { display: flex; flex-wrap: wrap; gap: 4px 12px; margin-top: 4px; }
.answer .label { color: var(--muted); margin-right: 4px; }
.badge { display: inline-block; padding: 0 6px; border-radius: 10px; font-size: 12px; font-weight: 600;
  background: var(--warn-wash); color: var(--warn); margin-right: 3px; }
.badge.code-OK { background: var(--ok-wash); color: var(--ok); }
.badge.cache { background: var(--wash); color: var(--ink); font-weight: 500; }
.answer.differs .badge { outline: 2px solid var(--bad); }
.answer .text { word-break: break-word; }
.violation-tag { color: var(--bad); font-weight: 700; }
details.why { margin-top: 4px; color: var(--muted); font-size: 12.5px; }
details.why summary { cursor: pointer; }
.fault-mark { border: 1px dashed var(--fault); background: var(--fault-wash); color: var(--fault);
  border-radius: 6px; padding: 5px 10px; }
.fault-mark .op { color: var(--fault); }
.engine-call { border-left-color: var(--accent); }
.phase { border: 2px solid var(--accent); border-radius: 8px; padding: 6px 8px; background: #f7f9fd; }
.phase.violating { border-color: var(--bad); background: var(--bad-wash); }
.phase-head { font-weight: 600; margin-bottom: 4px; }
table.phase-lanes { width: 100%; table-layout: fixed; }
table.phase-lanes th { background: var(--wash); padding: 4px; border-bottom: 2px solid var(--lane); }
table.phase-lanes th.tick, table.phase-lanes td.tick { width: 48px; color: var(--muted); text-align: right;
  padding-right: 8px; font-variant-numeric: tabular-nums; }
table.phase-lanes td { padding: 2px 4px; vertical-align: top; height: 22px; }
.lane-call .call-name { font-weight: 700; color: var(--accent); }
.lane-call .ticks { color: var(--muted); }
ul.notes { margin: 4px 0; padding-left: 20px; }
dl.reproduce, dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 14px; margin: 6px 0; }
dl.reproduce dt, dl.facts dt { color: var(--muted); }
dl.reproduce dd, dl.facts dd { margin: 0; word-break: break-all; }
table.seeds, table.nodes { border-collapse: collapse; margin: 8px 0; }
table.seeds th, table.seeds td, table.nodes th, table.nodes td { padding: 2px 14px 2px 0; text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 8px 36px; align-items: flex-start; }
.charts > section { flex: 0 1 auto; }
table.heatmap th, table.heatmap td { padding: 4px 6px; text-align: center; font-variant-numeric: tabular-nums; }
table.heatmap thead th { font-size: 11px; font-weight: 600; color: var(--muted); writing-mode: vertical-rl;
  transform: rotate(180deg); white-space: nowrap; height: 150px; vertical-align: bottom; }
table.heatmap tbody th { text-align: right; padding-right: 10px; }
td.cell { min-width: 44px; border: 1px solid #fff; font-size: 12.5px; }
td.cell.gap { color: #9aa3b2; background: repeating-linear-gradient(45deg, #f6f7f9, #f6f7f9 4px,
  #e6e9ef 4px, #e6e9ef 8px); }
td.heat-1 { background: #e4ecfa; }
td.heat-2 { background: #bfd2f3; }
td.heat-3 { background: #8fb0e8; }
td.heat-4 { background: #5a88d6; color: #fff; }
td.heat-5 { background: #2c5fb3; color: #fff; }
table.histogram td, table.histogram th { padding: 3px 6px; }
table.histogram th { text-align: right; font-weight: 600; font-variant-numeric: tabular-nums; }
td.bar-cell { width: 240px; }
#coverage { max-width: 700px; }
#sessions { max-width: 440px; }
.bar { height: 16px; background: var(--accent); border-radius: 3px; min-width: 2px; }
tr.gap .bar { background: repeating-linear-gradient(45deg, #f6f7f9, #f6f7f9 4px, #e6e9ef 4px, #e6e9ef 8px);
  width: 100%; border: 1px dashed #c9ced8; }
td.count { font-variant-numeric: tabular-nums; text-align: right; }
table.options td, table.options th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
table.options th { color: var(--muted); font-weight: 500; }
@media print { details { display: block; } body { max-width: none; } }
"""

"""The ``--html`` page's whole stylesheet: fixed text, no string from a log ever goes in it."""

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{padding:0 24px 40px}
.banner{padding:16px 24px;color:#fff}
.banner h1{margin:0 0 4px;font-size:22px}
.banner p{margin:2px 0}
.banner .notice{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;white-space:pre-wrap}
.banner .note{color:#eee}
.b-ok{background:#2e7d32}.b-dense{background:#b3261e}.b-crash{background:#6d0f0a}.b-stopped{background:#a75a00}.b-none{background:#555}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 7px;vertical-align:top;text-align:left}
th{background:#f0f0f0}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.dense td{background:#fdecea}
td.dense{color:#b3261e;font-weight:600}
.muted{color:#666}
.note{color:#666;font-size:12px}
code,pre{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#fff;border:1px solid #ddd;padding:6px;white-space:pre-wrap;word-break:break-all;max-height:24em;overflow:auto}
td{word-break:break-word;max-width:40em}
td.n,td.phase{white-space:nowrap;word-break:normal}
td.layer{min-width:14em}
td.causes span{white-space:nowrap}
.scroll{overflow-x:auto}
svg text{font:11px system-ui,sans-serif;fill:#333}
svg .dense-label{fill:#b3261e;font-weight:600}
dl.kv{display:grid;grid-template-columns:max-content auto;gap:2px 12px;margin:0}
dl.kv dt{color:#555}dl.kv dd{margin:0}
"""

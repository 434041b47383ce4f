"""Studies: declared in TOML (`spec`), swept in worker processes (`sweep`, `worker`),
recorded per run (`records`), tabulated with intervals over seeds (`table`, `published`)
and plotted (`curves`). The experiment layer: it composes `stepcredit.train` and
`stepcredit.diagnose`, and nothing below it imports it."""

"""Stage 9, report: the run's HTML pages and summary.json (stage, pages), their headline figures
(headline), inline SVG charts (charts) and the benchmarks' figures (benchmarks)."""

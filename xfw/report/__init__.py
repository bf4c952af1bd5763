"""Reporting: pure functions from run directories to numbers, tables, charts and pages.

* :mod:`~xfw.report.results`, :mod:`~xfw.report.measure`  a run directory loaded; statistics from raw records
* :mod:`~xfw.report.mfu`, :mod:`~xfw.report.estimate`  FLOPs utilisation; predicted memory
* :mod:`~xfw.report.compare`  backends side by side, per (recipe, variant)
* :mod:`~xfw.report.history`, :mod:`~xfw.report.verdicts`  the nightly history and its regression rules
* :mod:`~xfw.report.table`  the one table model, rendered to markdown, CSV and HTML
* :mod:`~xfw.report.layouts`, :mod:`~xfw.report.plot`, :mod:`~xfw.report.pages`  the seed layouts, charts, HTML pages
* :mod:`~xfw.report.progress`  live progress while runs go

This layer imports only :mod:`xfw.contract`; it never launches anything.
"""

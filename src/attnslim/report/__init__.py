"""Markdown/HTML reports for compressed models."""

from attnslim.report.page import render, write_report

__all__ = ["render", "write_report"]

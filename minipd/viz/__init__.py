"""Plots the chapters share. Each function draws with matplotlib and returns the Axes it drew on.

matplotlib is imported only when a plot is drawn, so importing this package stays cheap.
"""

from minipd.viz.latency import latency_table, plot_latency_vs, plot_token_timeline, plot_ttft_tpot

__all__ = ["latency_table", "plot_latency_vs", "plot_token_timeline", "plot_ttft_tpot"]

"""The activity page: the last hour, per minute, as small charts drawn on the server (inline
SVG, no JavaScript), from what every process's aggregator wrote to Redis
(:func:`celery_steplock.activity.read`). Read-only: it needs
``celery_steplock.view_activity``.

Per task: the lease wait and hold times (p50 and p95, line charts), contention and
conflicts (bars); per rate limit: admitted and limited executions (bars); per circuit
breaker: its state as a band over the hour. Every chart's colours are the admin's CSS
variables (light and dark themes), and every chart has its numbers in a table below it
(``<details>``), for readers that do not see the picture.
"""

from __future__ import annotations

import datetime as dt
import html
from dataclasses import dataclass, field
from typing import Any, Sequence

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _
from redis.exceptions import RedisError

from .... import activity
from ....conf import Settings
from ....exceptions import StepLockError
from ....lock import get_lease_store
from ..leases import celery_app
from ..models import Activity
from ._common import LiveModelAdmin, _error_text

__all__ = ["ActivityAdmin", "MINUTES", "line_chart", "bar_chart", "band_chart", "render"]

#: The page's window, minutes.
MINUTES = 60

# Chart geometry (SVG user units; the SVG scales to its box's width).
WIDTH, HEIGHT = 320, 120
LEFT, RIGHT, TOP, BOTTOM = 44, 6, 8, 18


@dataclass
class Chart:
    """One chart's geometry, for the template: ``lines`` (``(css class, label, points)``
    with ``points`` one ``"x,y x,y"`` string per run of minutes with a value, and ``dots``
    for a lone minute), ``bars`` (``(css class, x, y, width, height)``), ``bands``
    (``(css class, x, width, label)``), the axis ticks, and ``rows``: the numbers per minute
    that has any, as text."""

    title: str
    legend: list[tuple[str, str]]
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    lines: list[tuple[str, str, list[str], list[tuple[float, float]]]] = field(
        default_factory=list
    )
    bars: list[tuple[str, float, float, float, float]] = field(default_factory=list)
    bands: list[tuple[str, float, float, str]] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    width: int = WIDTH
    height: int = HEIGHT
    plot_left: int = LEFT
    plot_right: int = WIDTH - RIGHT
    plot_top: int = TOP
    plot_bottom: int = HEIGHT - BOTTOM


def _escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def render(chart: Chart, label: str) -> SafeString:
    """One chart as HTML: a ``<figure>`` with its caption and legend, the inline SVG (with
    a ``<title>`` and ``aria-label``) and its numbers in a ``<details>`` table. Built here
    rather than by a template loop: an hour of 20 tasks is 60 charts and 3,600 table rows,
    which Django's template engine renders several times slower. Every text is escaped
    (:func:`html.escape`, quotes included).
    """
    e = _escape
    name = f"{e(chart.title)}: {e(label)}"
    out = ['<figure class="sl-chart"><figcaption>', str(e(chart.title))]
    for css, text in chart.legend:
        out.append(f' <span class="sl-key {e(css)}" aria-hidden="true"></span>{e(text)}')
    out.append(
        f'</figcaption><svg viewBox="0 0 {chart.width} {chart.height}" role="img" '
        f'aria-label="{name}" preserveAspectRatio="none"><title>{name}</title>'
        f'<line class="axis" x1="{chart.plot_left}" y1="{chart.plot_bottom}" '
        f'x2="{chart.plot_right}" y2="{chart.plot_bottom}"/>'
    )
    for y, text in chart.y_ticks:
        out.append(
            f'<line class="grid" x1="{chart.plot_left}" y1="{y}" x2="{chart.plot_right}" '
            f'y2="{y}"/><text x="{chart.plot_left - 3}" y="{y}" class="ytick">{e(text)}</text>'
        )
    for x, text in chart.x_ticks:
        out.append(f'<text x="{x}" y="{chart.height - 4}" class="xtick">{e(text)}</text>')
    for css, x, y, w, h in chart.bars:
        out.append(f'<rect class="{e(css)}" x="{x}" y="{y}" width="{w}" height="{h}"/>')
    for css, x, w, text in chart.bands:
        out.append(
            f'<rect class="{e(css)}" x="{x}" y="{chart.plot_top}" width="{w}" '
            f'height="{chart.plot_bottom - 8}"><title>{e(text)}</title></rect>'
        )
    for css, _name, lines, dots in chart.lines:
        for points in lines:
            out.append(f'<polyline class="{e(css)}" points="{points}"/>')
        for x, y in dots:
            out.append(f'<circle class="{e(css)}" cx="{x}" cy="{y}" r="1.8"/>')
    out.append(
        f'</svg><details><summary>{e(_("Numbers"))}</summary><table class="sl-numbers"><thead><tr>'
    )
    out.extend(f'<th scope="col">{e(column)}</th>' for column in chart.columns)
    out.append("</tr></thead><tbody>")
    for row in chart.rows:
        out.append("<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>")
    if not chart.rows:
        out.append(
            f'<tr><td colspan="{len(chart.columns)}">{e(_("Nothing in the last hour."))}</td></tr>'
        )
    out.append("</tbody></table></details></figure>")
    return mark_safe("".join(out))  # every value above is escaped


def _x(index: float, minutes: int) -> float:
    return round(LEFT + (WIDTH - LEFT - RIGHT) * index / minutes, 1)


def _y(value: float, top: float) -> float:
    span = HEIGHT - TOP - BOTTOM
    return round(HEIGHT - BOTTOM - span * (value / top if top else 0), 1)


def _nice(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (> 0)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** (len(str(int(value))) - 1) if value >= 1 else 1.0
    while power > value:
        power /= 10
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power  # pragma: no cover


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} s"


def _x_ticks(start: int, minutes: int) -> list[tuple[float, str]]:
    ticks = []
    for index in range(0, minutes + 1, 15):
        at = dt.datetime.fromtimestamp((start + index) * 60, tz=dt.timezone.utc)
        ticks.append((_x(index, minutes), timezone.localtime(at).strftime("%H:%M")))
    return ticks


def _minute_label(start: int, index: int) -> str:
    at = dt.datetime.fromtimestamp((start + index) * 60, tz=dt.timezone.utc)
    return timezone.localtime(at).strftime("%H:%M")


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[float | None]]],
    start: int,
    minutes: int,
) -> Chart:
    """Lines of durations (seconds) per minute.

    Args:
        title: The chart's title (its SVG ``<title>``).
        series: ``(css class, label, values)``, a value per minute, None for no sample.
        start: The first minute (Unix seconds // 60).
        minutes: Minutes shown.

    Returns:
        The :class:`Chart`.
    """
    peak = max((v for _c, _l, values in series for v in values if v is not None), default=0.0)
    top = _nice(peak)
    chart = Chart(
        title=title,
        legend=[(css, label) for css, label, _v in series],
        columns=[_("Minute")] + [label for _c, label, _v in series],
        y_ticks=[(_y(top * f, top), _seconds(top * f)) for f in (0.0, 0.5, 1.0)],
        x_ticks=_x_ticks(start, minutes),
    )
    for css, label, values in series:
        runs: list[list[tuple[float, float]]] = [[]]
        for index, value in enumerate(values):
            if value is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append((_x(index + 0.5, minutes), _y(value, top)))
        lines = [" ".join(f"{x},{y}" for x, y in run) for run in runs if len(run) > 1]
        dots = [run[0] for run in runs if len(run) == 1]
        chart.lines.append((css, label, lines, dots))
    for index in range(minutes):
        values = [values[index] for _c, _l, values in series]
        if any(v is not None for v in values):
            chart.rows.append([_minute_label(start, index)] + [_seconds(v) for v in values])
    return chart


def bar_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[int]]],
    start: int,
    minutes: int,
) -> Chart:
    """Stacked bars of counts per minute.

    Args:
        title: The chart's title.
        series: ``(css class, label, counts)``, a count per minute, stacked in this order.
        start: The first minute (Unix seconds // 60).
        minutes: Minutes shown.

    Returns:
        The :class:`Chart`.
    """
    totals = [sum(counts[i] for _c, _l, counts in series) for i in range(minutes)]
    top = _nice(max(totals, default=0))
    chart = Chart(
        title=title,
        legend=[(css, label) for css, label, _v in series],
        columns=[_("Minute")] + [label for _c, label, _v in series],
        y_ticks=[(_y(top * f, top), f"{top * f:g}") for f in (0.0, 0.5, 1.0)],
        x_ticks=_x_ticks(start, minutes),
    )
    width = round((WIDTH - LEFT - RIGHT) / minutes * 0.8, 1)
    for index in range(minutes):
        base = 0
        for css, _label, counts in series:
            count = counts[index]
            if count:
                y0, y1 = _y(base, top), _y(base + count, top)
                chart.bars.append((css, _x(index + 0.1, minutes), y1, width, round(y0 - y1, 1)))
                base += count
        if totals[index]:
            chart.rows.append(
                [_minute_label(start, index)] + [str(c[index]) for _c, _l, c in series]
            )
    return chart


STATE_LABELS = {"open": "open", "half_open": "half-open", "closed": "closed", "unknown": "?"}


def band_chart(
    title: str, transitions: Sequence[tuple[int, str]], start: int, minutes: int
) -> Chart:
    """A breaker's state as a band over the window: from each transition to the next (before
    the first: not known, the state was set earlier).

    Args:
        title: The chart's title.
        transitions: ``(seconds since the window's start, state)``, oldest first.
        start: The first minute (Unix seconds // 60).
        minutes: Minutes shown.

    Returns:
        The :class:`Chart`.
    """
    chart = Chart(
        title=title,
        legend=[(f"st-{state}", _(label)) for state, label in STATE_LABELS.items()],
        columns=[_("Time"), _("State")],
        x_ticks=_x_ticks(start, minutes),
        height=40,
        plot_bottom=22,
    )
    end = minutes * 60
    edges = [(0, "unknown"), *transitions]
    for (at, state), (until, _next) in zip(edges, [*edges[1:], (end, "")]):
        if until > at:
            x0, x1 = _x(at / 60, minutes), _x(until / 60, minutes)
            chart.bands.append((f"st-{state}", x0, round(x1 - x0, 1), _(STATE_LABELS[state])))
    for at, state in transitions:
        stamp = dt.datetime.fromtimestamp(start * 60 + at, tz=dt.timezone.utc)
        chart.rows.append([timezone.localtime(stamp).strftime("%H:%M:%S"), _(STATE_LABELS[state])])
    return chart


def charts(data: activity.Activity) -> dict[str, list[dict[str, Any]]]:
    """The page's charts of one :class:`~celery_steplock.activity.Activity`."""
    start, minutes = data.start, data.minutes
    tasks: list[dict[str, Any]] = []
    for task in data.tasks.values():
        tasks.append(
            {
                "name": task.name or _("(no task)"),
                "executions": sum(task.executions),
                "charts": [
                    line_chart(
                        _("Lease wait"),
                        [
                            ("s-p50", "p50", task.wait_p50),
                            ("s-p95", "p95", task.wait_p95),
                        ],
                        start,
                        minutes,
                    ),
                    line_chart(
                        _("Lease hold"),
                        [
                            ("s-p50", "p50", task.hold_p50),
                            ("s-p95", "p95", task.hold_p95),
                        ],
                        start,
                        minutes,
                    ),
                    bar_chart(
                        _("Executions, contention, conflicts, duplicates"),
                        [
                            ("s-exec", _("executions"), task.executions),
                            ("s-contended", _("contended"), task.contended),
                            ("s-conflict", _("conflicts"), task.conflicts),
                            ("s-duplicate", _("duplicates"), task.duplicates),
                        ],
                        start,
                        minutes,
                    ),
                ],
            }
        )
    limits: list[dict[str, Any]] = [
        {
            "name": limit.name,
            "chart": bar_chart(
                _("Admitted and limited"),
                [
                    ("s-admitted", _("admitted"), limit.admitted),
                    ("s-limited", _("limited"), limit.limited),
                ],
                start,
                minutes,
            ),
        }
        for limit in data.limits.values()
    ]
    breakers: list[dict[str, Any]] = [
        {"name": b.name, "chart": band_chart(_("State"), b.transitions, start, minutes)}
        for b in data.breakers.values()
    ]
    for drawn in tasks:
        drawn["html"] = [render(chart, drawn["name"]) for chart in drawn["charts"]]
    item: dict[str, Any]
    for item in (*limits, *breakers):
        item["html"] = render(item["chart"], item["name"])
    return {"tasks": tasks, "limits": limits, "breakers": breakers}


@admin.register(Activity)
class ActivityAdmin(LiveModelAdmin):
    """The last hour per minute, as charts (see the module). A field Redis holds that no
    aggregator writes is counted as malformed and shown as a count, never an error page."""

    change_list_template = "admin/celery_steplock/activity/change_list.html"

    def get_urls(self):
        return [self.page_url("", self.changelist_view, "changelist")]

    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        data: activity.Activity | None = None
        drawn: dict[str, list[dict[str, Any]]] = {"tasks": [], "limits": [], "breakers": []}
        error, enabled = None, True
        try:
            app = celery_app()
            enabled = Settings(app).activity
            store = get_lease_store(app)
            data = activity.read(store.client, store.prefix, minutes=MINUTES)
            drawn = charts(data)
        except (StepLockError, RedisError) as exc:
            error = _error_text(exc)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Activity"),
            "activity": data,
            "minutes": MINUTES,
            "enabled": enabled,
            **drawn,
            "error": error,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)

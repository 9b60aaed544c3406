"""The fleet row's per-hop plots as a template filter: `{{ node.recent|hop_plots }}`."""

from __future__ import annotations

from django import template

from webapp.fleet.hopseries import HopPlots
from webapp.fleet.hopseries import hop_plots as build

register = template.Library()


@register.filter(name="hop_plots")
def hop_plots(ring: object) -> HopPlots | None:
    return build(ring)

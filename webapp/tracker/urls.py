"""Tracker URLs: announce and scrape (BEP 3/48) and the web seed (BEP 19), each with a node passkey."""

from __future__ import annotations

from django.urls import path

from webapp.tracker import views

app_name = "tracker"
urlpatterns = [
    path("tracker/<str:passkey>/announce", views.announce, name="announce"),
    path("tracker/<str:passkey>/scrape", views.scrape, name="scrape"),
    path("webseed/<str:passkey>/<str:sha256>", views.webseed, name="webseed"),
]

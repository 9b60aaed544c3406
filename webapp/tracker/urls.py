"""Tracker URLs: announce and scrape (BEP 3/48) and the web seed (BEP 19), each with a node passkey; the
artifact endpoints (manifest, .torrent, whole file with Range) for node credentials or staff."""

from __future__ import annotations

from django.urls import path

from webapp.tracker import views

app_name = "tracker"
urlpatterns = [
    path("tracker/<str:passkey>/announce", views.announce, name="announce"),
    path("tracker/<str:passkey>/scrape", views.scrape, name="scrape"),
    path("webseed/<str:passkey>/<str:sha256>", views.webseed, name="webseed"),
    path("artifacts/<str:sha256>/manifest", views.artifact_manifest, name="manifest"),
    path("artifacts/<str:sha256>/file", views.artifact_file, name="file"),
    path("artifacts/<str:sha256>/torrent", views.artifact_torrent, name="torrent"),
]

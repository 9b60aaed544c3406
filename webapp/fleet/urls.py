"""Fleet URLs (pages and placement for staff, the enrollment API for agents)."""

from __future__ import annotations

from django.urls import path

from webapp.fleet import views

app_name = "fleet"
urlpatterns = [
    path("fleet/", views.index, name="index"),
    path("fleet/tokens", views.create_token, name="create_token"),
    path("fleet/nodes/<str:node_id>/drain", views.drain, name="drain"),
    path("fleet/nodes/<str:node_id>/remove", views.remove, name="remove"),
    path("fleet/placement/", views.placement, name="placement"),
    path("models/<int:artifact_id>/place", views.place, name="place"),
    path("models/<int:artifact_id>/unplace", views.unplace, name="unplace"),
    path("fleet/status.json", views.status_json, name="status"),
    path("fleet/history.json", views.history_json, name="history"),
    path("api/agent/enroll", views.enroll_api, name="enroll_api"),
    path("api/agent/certificate", views.certificate_api, name="certificate_api"),
]

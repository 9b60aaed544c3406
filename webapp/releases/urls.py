"""Release URLs (the releases page and its actions for staff, the wheel download for nodes)."""

from __future__ import annotations

from django.urls import path

from webapp.releases import views

app_name = "releases"
urlpatterns = [
    path("releases/", views.index, name="index"),
    path("releases/publish", views.publish, name="publish"),
    path("releases/status.json", views.status_json, name="status"),
    path("releases/<int:release_id>/rollout", views.start, name="start"),
    path("releases/<int:release_id>/wheel", views.wheel, name="wheel"),
    path("rollouts/<int:rollout_id>/pause", views.pause, name="pause"),
    path("rollouts/<int:rollout_id>/resume", views.resume, name="resume"),
    path("rollouts/<int:rollout_id>/rollback", views.roll_back, name="rollback"),
]

"""Root URL configuration."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from webapp.core import views as core_views
from webapp.core.login import ThrottledLoginView
from webapp.metrics import metrics_view

urlpatterns = [
    path("", core_views.home, name="home"),
    path("healthz", core_views.healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("accounts/login/", ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("webapp.catalog.urls")),
    path("", include("webapp.fleet.urls")),
    path("", include("webapp.playground.urls")),
    path("", include("webapp.api.urls")),
    path("", include("webapp.routing.urls")),
    path("", include("webapp.tracker.urls")),
    path("", include("webapp.releases.urls")),
]

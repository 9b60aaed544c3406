"""Routing URLs: the sessions-and-answers panel of the fleet page."""

from __future__ import annotations

from django.urls import path

from webapp.routing import views

app_name = "routing"
urlpatterns = [path("fleet/generations", views.generations, name="generations")]

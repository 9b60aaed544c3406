"""Playground URLs: the page, and the JSON of a user's saved conversations."""

from __future__ import annotations

from django.urls import path

from webapp.playground import views

app_name = "playground"
urlpatterns = [
    path("playground/", views.index, name="index"),
    path("playground/conversations.json", views.conversations, name="conversations"),
    path("playground/conversations/<int:pk>.json", views.conversation, name="conversation"),
    path("playground/conversations/<int:pk>/rename", views.rename, name="rename"),
    path("playground/conversations/<int:pk>/delete", views.delete, name="delete"),
]

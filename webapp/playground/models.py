"""Playground models: a user's saved conversations and their messages."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from webapp.playground.chat import TITLE_CHARS


class Conversation(models.Model):
    """One chat of one user: its model, system prompt and sampling settings; messages hang off it."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations")
    artifact = models.ForeignKey(
        "catalog.ModelArtifact", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    title = models.CharField(max_length=TITLE_CHARS, blank=True, default="")
    system_prompt = models.TextField(blank=True, default="")
    settings = models.JSONField(default=dict, blank=True, help_text="last sampling options used")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at", "-id"]
        indexes = [models.Index(fields=["user", "-updated_at"], name="conversation_user_recent")]

    def __str__(self) -> str:
        return f"conversation {self.pk} of {self.user_id}: {self.title!r}"


class Message(models.Model):
    """One turn of a conversation; an assistant answer keeps its telemetry and whether Stop cut it."""

    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages")
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField()
    stopped = models.BooleanField(default=False, help_text="the answer was cut short by Stop")
    telemetry = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.role} message {self.pk} in conversation {self.conversation_id}"

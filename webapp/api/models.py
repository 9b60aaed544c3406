"""API keys (hashed at rest, prefix visible) and their per-day usage."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ApiKey(models.Model):
    """A user's bearer key for /v1/; only its sha256 is stored, the secret is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=24, help_text="the key's first characters, shown to tell keys apart")
    hashed = models.CharField(max_length=64, unique=True, help_text="sha256 of the whole key, hex")
    rate_limit_per_min = models.PositiveIntegerField(default=60, help_text="requests per minute")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class ApiUsage(models.Model):
    """One key's requests and tokens on one UTC day."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    day = models.DateField()
    requests = models.PositiveIntegerField(default=0)
    tokens_in = models.BigIntegerField(default=0)
    tokens_out = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-day"]
        constraints = [models.UniqueConstraint(fields=["key", "day"], name="unique_api_usage_key_day")]

    def __str__(self) -> str:
        return f"{self.key_id} {self.day}: {self.tokens_in} in, {self.tokens_out} out"

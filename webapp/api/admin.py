"""Admin: API keys with their usage, for the operator."""

from __future__ import annotations

from django.contrib import admin

from webapp.api.models import ApiKey, ApiUsage


class ApiUsageInline(admin.TabularInline):
    model = ApiUsage
    extra = 0
    readonly_fields = ("day", "requests", "tokens_in", "tokens_out")
    can_delete = False


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "user", "rate_limit_per_min", "created_at", "last_used", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "user__username")
    readonly_fields = ("prefix", "hashed", "created_at", "last_used")
    inlines = [ApiUsageInline]


@admin.register(ApiUsage)
class ApiUsageAdmin(admin.ModelAdmin):
    list_display = ("key", "day", "requests", "tokens_in", "tokens_out")
    list_filter = ("day",)

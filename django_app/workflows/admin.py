from django.contrib import admin

from celery_steplock.contrib.django.mixins import GuardedStepAdminMixin

from .models import Step, TransitionRecord


class TransitionRecordInline(admin.TabularInline):
    model = TransitionRecord
    extra = 0
    can_delete = False
    fields = (
        "from_status",
        "to_status",
        "task_name",
        "task_id",
        "owner",
        "fence",
        "hostname",
        "pid",
        "created_at",
    )
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Step)
class StepAdmin(GuardedStepAdminMixin, admin.ModelAdmin):
    """Steps: the status, owner and fence are read-only; a status change ("Change status
    to") is a guarded transition under the lease the step's tasks take (``step:<id>``)."""

    # By name: importing the tasks module here would import it in every web process at
    # django.setup() (the admin's autodiscovery); the mixin imports it when first needed.
    steplock_task = "django_app.workflows.tasks.advance"
    list_display = ("id", "name", "status", "lock_owner", "lock_fence", "updated_at")
    list_filter = ("status",)
    search_fields = ("name", "lock_owner")
    inlines = (TransitionRecordInline,)


@admin.register(TransitionRecord)
class TransitionRecordAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "step",
        "from_status",
        "to_status",
        "task_name",
        "owner",
        "fence",
        "hostname",
        "pid",
        "created_at",
    )
    list_filter = ("to_status", "task_name")
    search_fields = ("task_id", "owner")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

from django.contrib import admin
from django.urls import include, path

from django_app.faults import probe

urlpatterns = [
    path("admin/", admin.site.urls),
]
if probe.enabled():  # STEPLOCK_FAULTS=1: the fault suite's HTTP load (faults/http_views.py)
    urlpatterns.append(path("faults/http/", include("django_app.faults.http_views")))

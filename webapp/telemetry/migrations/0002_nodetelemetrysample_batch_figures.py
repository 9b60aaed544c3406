# Per-hop batching figures on node samples (the fleet page's "Batching per hop" chart).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("telemetry", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="nodetelemetrysample",
            name="batch_steps",
            field=models.FloatField(default=0.0),
        ),
        migrations.AddField(
            model_name="nodetelemetrysample",
            name="queue_wait_ms",
            field=models.FloatField(default=0.0),
        ),
        migrations.AddField(
            model_name="nodetelemetrysample",
            name="batch_compute_ms",
            field=models.FloatField(default=0.0),
        ),
    ]

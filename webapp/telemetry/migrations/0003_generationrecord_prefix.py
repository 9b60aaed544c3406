# The shared prefix (system prompt) of an answer and whether its hops restored it (issue 32).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("telemetry", "0002_nodetelemetrysample_batch_figures"),
    ]

    operations = [
        migrations.AddField(
            model_name="generationrecord",
            name="prefix_shared_tokens",
            field=models.IntegerField(default=0),
        ),
        migrations.AddField(
            model_name="generationrecord",
            name="prefix_hit",
            field=models.BooleanField(default=False),
        ),
    ]

# Issue 14: two copies of each layer range by default, settable per model (1 to 64).

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0002_artifact_torrent"),
    ]

    operations = [
        migrations.AlterField(
            model_name="modelartifact",
            name="desired_replicas",
            field=models.PositiveSmallIntegerField(
                default=2,
                help_text="copies of each layer range placement keeps when the fleet's memory allows",
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(64),
                ],
            ),
        ),
    ]
